"""dsx3d.Trainer with a padding-free collator (transformers' DataCollatorWithFlattening: one flat row of the
batch's examples, documents marked by position_ids) gives the per-step losses and gradient norms of plain
single-process transformers.Trainer with the same collator, on both engines; the batch conversion keeps
documents whole and refuses what it cannot reproduce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.errors import UserError
from dsx3d.integrations.batches import to_micro_batch
from dsx3d.models.packed import document_lengths
from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import (
    ACCUM,
    SEQ,
    VOCAB,
    step_values,
    tiny_llama,
    training_args,
    write_ds_config,
)

pytestmark = pytest.mark.usefixtures("warm")

TOL = 1e-5


def varied_set(samples: int = 48) -> Any:
    """Examples of 2 to SEQ tokens, some labels ignored."""
    import datasets

    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(samples):
        n = int(torch.randint(2, SEQ + 1, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[torch.rand(n, generator=g) < 0.2] = -100
        rows.append((ids.tolist(), labels.tolist()))
    return datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})


def _collator() -> Any:
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)


def _run(rank: int, work: Path, ds_config: Path | None, dp: int) -> list[dict[str, Any]]:
    import transformers

    import dsx3d

    if ds_config is None:
        cls: Any = transformers.Trainer
        args = training_args(work / "ref", gradient_accumulation_steps=ACCUM * dp)
    else:
        cls = dsx3d.Trainer
        args = training_args(work / "3d", deepspeed=str(ds_config))
    trainer = cls(model=tiny_llama(), args=args, train_dataset=varied_set(), data_collator=_collator())
    trainer.train()
    return trainer.state.log_history


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 1, 1)], ids=lambda t: f"dp{t[0]}-tp{t[1]}-pp{t[2]}")
def test_flattening_collator_matches_plain_trainer(tmp_path: Path, layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    ds_config = write_ds_config(tmp_path / "ds.json", dp, tp, pp)
    ours = run_ranks(_run, dp * tp * pp, tmp_path, ds_config, dp)[0]
    ref = run_ranks(_run, 1, tmp_path, None, dp)[0]
    for key, tol in (("loss", TOL), ("grad_norm", 1e-4)):
        a, b = step_values(ours, key), step_values(ref, key)
        assert len(a) == len(b) == 4, (key, a, b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (key, a, b)


def test_flat_row_becomes_rows_of_whole_documents() -> None:
    batch = _collator()([{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in (10, 7, 9, 3)])
    (ids, positions), labels = to_micro_batch(batch, 3, 16)
    assert ids.shape == positions.shape == labels.shape == (3, 16)
    assert [document_lengths(p) for p in positions] == [[10, 6], [7, 9], [3, 13]]  # next-fit, in order
    scored = int((labels[:, 1:] != -100).sum())
    assert scored == int((batch["labels"][:, 1:] != -100).sum()) == 9 + 6 + 8 + 2
    # each document keeps its tokens, in order, and starts a new position run with an ignored first label
    flat = [int(t) for r in range(3) for t, p in zip(ids[r], positions[r], strict=True)]
    assert flat.count(1) == 4 and all(int(labels[r][p == 0][0]) == -100 for r, p in enumerate(positions))


def test_padding_free_batches_that_cannot_fit_or_cross_documents_are_refused() -> None:
    collate = _collator()
    batch = collate([{"input_ids": list(range(1, 13)), "labels": list(range(1, 13))} for _ in range(3)])
    with pytest.raises(UserError, match="need 3 rows"):
        to_micro_batch(batch, 2, 16)
    with pytest.raises(UserError, match="longer than the layout's seq_len"):
        to_micro_batch(batch, 4, 8)
    batch["labels"][0, 12] = 5  # the second document's first token scored: a cross-document target
    with pytest.raises(UserError, match="first token of a document"):
        to_micro_batch(batch, 4, 16)
    no_positions = {k: v for k, v in batch.items() if k != "position_ids"}
    with pytest.raises(UserError, match="position_ids"):
        to_micro_batch(no_positions, 4, 16)
