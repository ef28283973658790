"""The bf16 shadow of verify's reference (dsx3d.verify.bf16_roundoff) runs the computation the 3D side runs: DeepSpeed
casts a bf16 model's parameters and leaves its buffers (rotary frequency tables) in fp32, so the shadow's loss
on one micro-batch is exactly the loss of a model cast that way, not of one whose buffers were rounded too."""

from __future__ import annotations

import pytest
import torch

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.bf16_roundoff import bf16_like_deepspeed, bf16_shadow


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=301, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).train()


def test_the_shadow_casts_parameters_and_keeps_buffers() -> None:
    model = _model()
    shadow = bf16_like_deepspeed(model)
    assert {p.dtype for p in shadow.parameters()} == {torch.bfloat16}
    buffers = dict(shadow.named_buffers())
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values()), {n: b.dtype for n, b in buffers.items()}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the reference itself is untouched


def test_the_shadow_loss_is_the_deepspeed_cast_model_loss() -> None:
    model = _model()
    ids = torch.randint(0, 301, (2, 48), generator=torch.Generator().manual_seed(1))
    cast = _model()
    for p in cast.parameters():
        p.data = p.data.to(torch.bfloat16)  # what DeepSpeed's engine does with bf16 enabled
    with torch.no_grad():
        expected = float(cast(input_ids=ids, labels=ids).loss)

    def accumulate(m: torch.nn.Module) -> float:
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss)

    loss, grads = bf16_shadow(model, accumulate)
    assert loss == expected
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_token_roundoff_bounds_a_loss_distance_that_cancelled():
    """Two micro-batches whose token losses moved by +-e and +-3e: the means agree exactly (a cancelled draw),
    the bound without cancellation is the mean |move|, and it bounds any signs of the same moves."""
    from dsx3d.verify.reference import token_roundoff

    e = 1e-3
    ref = [torch.tensor([5.0, 4.0, 6.0, 5.5], dtype=torch.float64), torch.tensor([3.0, 7.0], dtype=torch.float64)]
    moves = [torch.tensor([e, -e, e, -e], dtype=torch.float64), torch.tensor([3 * e, -3 * e], dtype=torch.float64)]
    shadow = [r + m for r, m in zip(ref, moves, strict=True)]
    mean = lambda ts: sum(float(t.double().mean()) for t in ts) / len(ts)  # noqa: E731
    assert abs(mean(shadow) - mean(ref)) < 1e-6
    bound = token_roundoff(ref, shadow)
    assert bound == pytest.approx((e + 3 * e) / 2, rel=1e-5)
    same_sign = [r + m.abs() for r, m in zip(ref, moves, strict=True)]
    assert abs(mean(same_sign) - mean(ref)) <= bound * (1 + 1e-5)
    assert token_roundoff([], []) == 0.0
