"""The bf16 shadow of verify's reference (dsx3d.verify.bf16_roundoff) runs the computation the 3D side runs: DeepSpeed
casts a bf16 model's parameters and leaves its buffers (rotary frequency tables) in fp32, so the shadow's loss
on one micro-batch is exactly the loss of a model cast that way, not of one whose buffers were rounded too."""

from __future__ import annotations

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
