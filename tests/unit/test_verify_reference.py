"""The verify reference's data and its refusal of a reference that is not finite.

Found by the schedule sweep (seed 11): a bf16 GLM-4 whose drawn batch started a sequence with token 0, the
padding id. HF zeroes that embedding row; with zero biases the position's hidden state stays exactly zero, and
RMSNorm's gradient there is 1/sqrt(eps) per norm: plain HF's own gradient norm was NaN in fp32, and verify
reported it as a mismatch of the parallel run."""

from __future__ import annotations

import math

import pytest
import torch

from dsx3d.errors import UserError
from dsx3d.verify import parity
from dsx3d.verify.case import ParityCase, make_batches, micro_batch
from dsx3d.verify.reference import Reference, build_reference


def _glm4_case(**overrides: object) -> ParityCase:
    from transformers import Glm4Config

    dims = dict(
        vocab_size=127, hidden_size=72, intermediate_size=72, num_hidden_layers=8, num_attention_heads=6,
        num_key_value_heads=6, head_dim=12, attention_bias=True, tie_word_embeddings=True, pad_token_id=0,
        max_position_embeddings=64,
    )
    dims.update(overrides)
    return ParityCase(Glm4Config(**dims), dp=1, tp=1, pp=4, micro_batches=8, steps=2, dtype="bf16")


def test_batches_leave_out_the_padding_token_and_nothing_else() -> None:
    case = _glm4_case()
    ids = make_batches(case)
    free = make_batches(_glm4_case(pad_token_id=None))  # a config without a padding id keeps every drawn id
    assert (free == 0).any() and not (ids == 0).any()
    assert torch.equal(ids, torch.where(free == 0, 1, free))
    pattern = make_batches(ParityCase(case.config, dp=1, tp=1, pp=4, micro_batches=8, steps=2, data="pattern"))
    assert not (pattern == 0).any()


def test_plain_hf_trains_on_the_batches_of_the_case_the_sweep_found() -> None:
    """With token 0 leading a sequence, plain HF's fp32 gradient is not finite; without it, it is."""
    case = _glm4_case()
    model = build_reference(case)
    leading_pad = torch.tensor([[0, 115, 27, 120, 38, 118]])
    model(input_ids=leading_pad, labels=leading_pad).loss.backward()
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    batch = make_batches(case)[0]
    for k in range(case.micro_batches):
        ids = micro_batch(case, batch, k, 0)
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("losses, norms", [([4.8, 4.9], [math.nan, 2.7]), ([math.inf, 4.9], [2.7, 2.6])])
def test_a_reference_that_is_not_finite_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, losses: list[float], norms: list[float]
) -> None:
    case = _glm4_case()
    monkeypatch.setattr(parity, "run_reference", lambda *a, **k: Reference(losses, norms, []))
    with pytest.raises(UserError) as err:
        parity._reference(case, torch.nn.Linear(1, 1), torch.zeros(1))
    text = str(err.value)
    assert "glm4" in text and "no reference to compare with" in text and "step 1" in text


def test_a_finite_reference_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = Reference([4.8, 4.9], [2.7, 2.6], [])
    monkeypatch.setattr(parity, "run_reference", lambda *a, **k: ref)
    assert parity._reference(_glm4_case(), torch.nn.Linear(1, 1), torch.zeros(1)) is ref
