"""Masked (SFT) loss: prompt and template tokens carry no loss, and the loss of a step is the per-token mean
over the whole global batch, as single-process HF computes it with `num_items_in_batch`, at two layouts
with micro-batches holding very different numbers of tokens with loss (a mean per micro-batch, averaged over
micro-batches and DP ranks, would differ: the test checks that it does)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsx3d.data.chat import DEFAULT_CHAT_TEMPLATE, IGNORE_INDEX, encode_conversation, example_messages
from dsx3d.data.stream import counted_tokens, with_norm
from dsx3d.data.tokenizer import train_bpe_tokenizer
from dsx3d.models.known_families import tiny_config
from dsx3d.verify.parity import ParityCase, build_case_engine, build_reference

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Spell cat backwards."},
    {"role": "assistant", "content": "tac"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from dsx3d.data.corpus import python_docs_documents

    return train_bpe_tokenizer(python_docs_documents()[:40], 400)


@pytest.mark.parametrize("generation_blocks", [True, False], ids=["generation-blocks", "prefixes"])
def test_only_assistant_tokens_carry_loss(tokenizer: Any, generation_blocks: bool) -> None:
    """Every label outside the assistant's turns is -100: system and user text, role headers, the generation
    prompt. The labelled tokens are exactly each assistant turn followed by the template's end of turn (eos),
    found from {% generation %} blocks or, without them, from the template's prefixes."""
    template = DEFAULT_CHAT_TEMPLATE
    if not generation_blocks:
        template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ids, labels = encode_conversation(tokenizer, CONVERSATION, template)
    assert len(ids) == len(labels)
    kept = [i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels, strict=True))
    assert tokenizer.decode(kept) == "2 plus 3 is 5.<|endoftext|>tac<|endoftext|>"
    masked = tokenizer.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])
    assert masked == "<|system|>\nBe brief.\n<|user|>\nWhat is 2 plus 3?\n<|assistant|>\n<|user|>\nSpell cat backwards.\n<|assistant|>\n"


def test_instruction_rows_are_a_user_and_an_assistant_turn(tokenizer: Any) -> None:
    from dsx3d.recipe.schema import DataSection

    messages = example_messages({"prompt": "Say hi.", "response": "hi"}, DataSection(format="instruction"))
    ids, labels = encode_conversation(tokenizer, messages, DEFAULT_CHAT_TEMPLATE)
    assert tokenizer.decode([lab for lab in labels if lab != IGNORE_INDEX]) == "hi<|endoftext|>"
    assert tokenizer.decode(ids).startswith("<|user|>\nSay hi.\n<|assistant|>\n")


# --- per-token normalisation against single-process HF ------------------------------------------------

STEPS = 2


def _masked_data(case: ParityCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps, B, S) ids and labels; row r keeps loss on a stretch whose length varies from 1 token to
    nearly the whole row, so micro-batches hold very different numbers of tokens with loss."""
    g = torch.Generator().manual_seed(11)
    vocab = case.config.vocab_size
    ids = torch.randint(0, vocab, (STEPS, case.global_batch, case.seq_len), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for s in range(STEPS):
        for r in range(case.global_batch):
            length = 1 if r % 3 == 0 else int(torch.randint(2, case.seq_len - 1, (1,), generator=g))
            start = case.seq_len - length
            labels[s, r, start:] = ids[s, r, start:]
    return ids, labels


def _micro(case: ParityCase, t: torch.Tensor, k: int, d: int) -> torch.Tensor:
    i = (k * case.dp + d) * case.micro_batch_size
    return t[i : i + case.micro_batch_size]


def _worker(rank: int, case: ParityCase, state: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor) -> Any:

    engine = build_case_engine(case, state)
    parts = case.micro_batches * case.dp
    losses, norms = [], []
    for s in range(STEPS):
        n = int(counted_tokens(labels[s].numpy()).sum())
        d = engine.placement.dp
        micro = [(_micro(case, ids[s], k, d), with_norm(_micro(case, labels[s], k, d), n, parts)) for k in range(case.micro_batches)]
        losses.append(engine.train_step(iter(micro)))
        norms.append(engine.grad_norm)
    return losses, norms


def _reference(case: ParityCase, model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[list[float], list[float], list[float]]:
    """HF on one process: per step, the global per-token loss (num_items_in_batch), its gradient norm, and
    the mean of per-micro-batch means (what the normalisation must not compute)."""
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    losses, norms, naive = [], [], []
    for s in range(STEPS):
        n = int(counted_tokens(labels[s].numpy()).sum())
        opt.zero_grad()
        total, means = 0.0, []
        for k in range(case.micro_batches):
            for d in range(case.dp):
                x, y = _micro(case, ids[s], k, d), _micro(case, labels[s], k, d)
                out = model(input_ids=x, labels=y, num_items_in_batch=n)
                out.loss.backward()
                total += out.loss.item()
                means.append(model(input_ids=x, labels=y).loss.item())
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        losses.append(total)
        naive.append(sum(means) / len(means))
        opt.step()
    return losses, norms, naive


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize(
    "layout", [(2, 1, 2), (2, 2, 1)], ids=lambda t: f"dp{t[0]}-tp{t[1]}-pp{t[2]}"
)
def test_masked_loss_is_the_global_per_token_mean(layout: tuple[int, int, int]) -> None:
    from dsx3d.verify.harness import run_ranks

    dp, tp, pp = layout
    case = ParityCase(
        tiny_config("llama", tie_word_embeddings=False, initializer_range=0.2), dp=dp, tp=tp, pp=pp, micro_batches=2,
        optimizer="sgd", lr=0.01, grad_clip=0.0, seq_len=16,
    )
    model = build_reference(case)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids, labels = _masked_data(case)
    ref_losses, ref_norms, naive = _reference(case, model, ids, labels)
    got_losses, got_norms = run_ranks(_worker, case.world_size, case, state, ids, labels)[0]
    # the data tells the normalisations apart: a mean per micro-batch is far off
    assert all(abs(a - b) > 1e-2 for a, b in zip(naive, ref_losses, strict=True)), (naive, ref_losses)
    # the second step's loss follows an SGD step with the first step's gradient: the gradient is right too
    assert got_losses == pytest.approx(ref_losses, rel=1e-5), (got_losses, ref_losses)
    assert got_norms == pytest.approx(ref_norms, rel=1e-5), (got_norms, ref_norms)
