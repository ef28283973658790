"""data.packing for chat and instruction data: whole examples best-fit packed into rows, position_ids
restarting at every example; the loss of a `dsx3d train` step (the stream's packed micro-batches through the
engine at dp 2 x pp 2) is the global per-token mean single-process HF computes on the same examples, each
alone; the padding fraction of a step; the recipe key refused where it does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dsx3d.data.chat import IGNORE_INDEX
from dsx3d.data.sft_packing import pack_examples
from dsx3d.data.stream import MicroBatchStream, counted_tokens
from dsx3d.models.known_families import tiny_config
from dsx3d.verify.parity import ParityCase, build_case_engine, build_reference

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
PAD = 0


def _examples(num: int, seq_len: int, vocab: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded examples of 10% .. 100% of seq_len tokens, the loss on a suffix of random length (an answer)."""
    g = np.random.default_rng(seed)
    ids = np.full((num, seq_len), PAD, dtype=np.int64)
    labels = np.full((num, seq_len), IGNORE_INDEX, dtype=np.int32)
    lengths = g.integers(max(2, seq_len // 10), seq_len + 1, size=num).astype(np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = g.integers(1, vocab, size=n)
        answer = int(g.integers(1, n))
        labels[i, n - answer : n] = ids[i, n - answer : n]
    return ids, labels, lengths


def test_packed_rows_hold_whole_examples_with_their_masks() -> None:
    ids, labels, lengths = _examples(40, 24, 100)
    labels[:, 0] = IGNORE_INDEX  # position 0 is never a target, packed or not
    packed = pack_examples(ids, labels, lengths, PAD)
    assert sorted(i for m in packed.members for i in m) == list(range(40))
    assert len(packed.input_ids) < 40  # rows are shared
    for r, members in enumerate(packed.members):
        at = 0
        for i in members:
            n = int(lengths[i])
            assert packed.input_ids[r, at : at + n].tolist() == ids[i, :n].tolist()
            assert packed.labels[r, at : at + n].tolist() == labels[i, :n].tolist()
            assert packed.positions[r, at : at + n].tolist() == list(range(n))
            at += n
        assert at == packed.lengths[r] <= 24
        assert (packed.labels[r, at:] == IGNORE_INDEX).all() and (packed.input_ids[r, at:] == PAD).all()
    # the tokens with loss are the examples' own: the global normaliser does not change
    assert counted_tokens(packed.labels).sum() == counted_tokens(labels).sum()


def test_padding_fraction_of_a_step() -> None:
    ids, labels, lengths = _examples(64, 32, 100)
    padded = MicroBatchStream(ids, 2, 2, 2, 0, seed=5, labels=labels, lengths=lengths)
    packed_rows = pack_examples(ids, labels, lengths, PAD)
    packed = MicroBatchStream(
        packed_rows.input_ids, 2, 2, 2, 0, seed=5, labels=packed_rows.labels,
        positions=packed_rows.positions, lengths=packed_rows.lengths,
    )
    text = MicroBatchStream(ids, 2, 2, 2, 0, seed=5)
    for step in range(3):
        rows = padded._step_indices(step)
        assert padded.padding_fraction(step) == pytest.approx(1 - lengths[rows].sum() / (8 * 32))
        assert packed.padding_fraction(step) < padded.padding_fraction(step)
        assert text.padding_fraction(step) == 0.0
    (x, positions), (y, _) = next(packed)
    assert x.shape == positions.shape == y.shape == (2, 32) and positions.dtype == torch.long


def test_reporter_writes_padding_fraction(tmp_path: Path) -> None:
    from dsx3d.run.metrics import Throughput, read_metrics
    from dsx3d.run.progress import Reporter, format_log_line

    reporter = Reporter(tmp_path / "metrics.jsonl", 2, 0, 1, Throughput(100, 10, 1), enabled=True)
    reporter.step(1, 2.0, 1e-3, 1.0, 0.5, padding=0.25)
    reporter.step(2, 1.5, 1e-3, 1.0, 0.5, padding=0.125)
    reporter.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["padding_fraction"] for r in records] == [0.25, 0.125]
    assert "padding 12.5%" in format_log_line(records[1], 2)


def test_packing_is_refused_for_text_and_accepted_for_chat() -> None:
    from dsx3d.checks.data import data_problems
    from dsx3d.data.prepare import prepare_data
    from dsx3d.errors import UserError
    from dsx3d.recipe.schema import load_recipe, recipe_from_dict

    packed = load_recipe(ROOT / "recipes" / "tiny-sft-packed.yaml")
    assert packed.data.packing and not [p for p in data_problems(packed, 2) if p.key == "data.packing"]
    data = packed.model_dump(mode="json")
    data["data"].update(format="text", source="builtin:python-docs")
    text = recipe_from_dict(data)
    problems = [p for p in data_problems(text, 2) if p.key == "data.packing"]
    assert problems and problems[0].value is True and "data.format" in problems[0].fix
    with pytest.raises(UserError, match="data.packing"):
        prepare_data(text)


# --- the training step on packed rows against single-process HF on the examples alone ---------------------


def _worker(rank: int, case: ParityCase, state: dict[str, torch.Tensor], rows: Any) -> Any:

    engine = build_case_engine(case, state)
    stream = MicroBatchStream(
        rows.input_ids, case.micro_batch_size, case.micro_batches, case.dp, engine.placement.dp, seed=7,
        labels=rows.labels, positions=rows.positions, lengths=rows.lengths,
    )
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_step(iter([next(stream) for _ in range(case.micro_batches)])))
        norms.append(engine.grad_norm)
    return losses, norms


def _reference(case: ParityCase, model: torch.nn.Module, rows: Any, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> Any:
    """Per step: the examples the step's packed rows hold, each run alone by HF; loss = sum of token losses
    / their count (num_items_in_batch), SGD; and the same rows run packed without position_ids (attention
    across examples: what the test must tell apart)."""
    stream = MicroBatchStream(rows.input_ids, case.micro_batch_size, case.micro_batches, case.dp, 0, seed=7, labels=rows.labels)
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    losses, norms, crossing = [], [], []
    for step in range(STEPS):
        members = [i for r in stream._step_indices(step) for i in rows.members[r]]
        y_all = torch.from_numpy(labels[members].astype(np.int64))
        y_all[:, 0] = IGNORE_INDEX
        n = int(counted_tokens(y_all.numpy()).sum())
        opt.zero_grad()
        total = 0.0
        for i in members:
            k = int(lengths[i])
            x = torch.from_numpy(ids[i : i + 1, :k])
            out = model(input_ids=x, labels=torch.from_numpy(labels[i : i + 1, :k].astype(np.int64)), num_items_in_batch=n)
            out.loss.backward()
            total += out.loss.item()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        losses.append(total)
        with torch.no_grad():
            x, y = stream.global_batch(step)
            crossing.append(float(model(input_ids=x, labels=y, num_items_in_batch=n).loss))
        opt.step()
    return losses, norms, crossing


@pytest.mark.usefixtures("warm")
def test_packed_step_loss_is_the_examples_global_per_token_mean() -> None:
    from dsx3d.verify.harness import run_ranks

    case = ParityCase(
        tiny_config("llama", tie_word_embeddings=False, initializer_range=0.2), dp=2, pp=2, micro_batches=2,
        optimizer="sgd", lr=0.05, grad_clip=0.0, seq_len=24,
    )
    ids, labels, lengths = _examples(48, case.seq_len, case.config.vocab_size)
    rows = pack_examples(ids, labels, lengths, PAD)
    assert len(rows.input_ids) >= STEPS * case.global_batch
    model = build_reference(case)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_losses, ref_norms, crossing = _reference(case, model, rows, ids, labels, lengths)
    got_losses, got_norms = run_ranks(_worker, case.world_size, case, state, rows)[0]
    assert all(abs(a - b) > 1e-3 for a, b in zip(crossing, ref_losses, strict=True)), (crossing, ref_losses)
    assert got_losses == pytest.approx(ref_losses, rel=1e-5), (got_losses, ref_losses)
    assert got_norms == pytest.approx(ref_norms, rel=1e-5), (got_norms, ref_norms)
