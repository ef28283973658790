"""A bf16 run's buffers in HF's dtypes (dsx3d.models.buffer_dtypes): MiniMax's lightning-attention decays in bf16,
every rotary `inv_freq` in fp32, nothing cast in an fp32 run; MiniMax's bf16 forward fails without the cast (the
generated verify sweep's failure at seed 2077) and runs with it, as HF's own bf16 model does."""

from __future__ import annotations

import pytest
import torch

from dsx3d.models.buffer_dtypes import cast_buffers_as_hf, hf_buffer_dtypes
from dsx3d.models.family_spec import resolve_family
from dsx3d.models.known_families import tiny_config
from dsx3d.verify.bf16_roundoff import bf16_like_deepspeed


def _fp32_model(family: str) -> torch.nn.Module:
    config = tiny_config(family)
    torch.manual_seed(0)
    return resolve_family(config).lm_class._from_config(config, dtype=torch.float32)


def _params_to_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """As DeepSpeed's engine casts a bf16 model: the parameters only."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def test_buffers_take_the_dtypes_of_hf_bf16_model() -> None:
    config = tiny_config("minimax")
    wanted = hf_buffer_dtypes(config, torch.bfloat16)
    assert wanted[("MiniMaxLightningAttention", "diagonal_decay")] == torch.bfloat16
    assert wanted[("MiniMaxRotaryEmbedding", "inv_freq")] == torch.float32
    model = _params_to_bf16(_fp32_model("minimax"))
    cast = cast_buffers_as_hf(model, config, torch.bfloat16)
    assert cast and all(n.rsplit(".", 1)[-1] in {"slope_rate", "query_decay", "key_decay", "diagonal_decay"} for n in cast)
    hf = resolve_family(config).lm_class._from_config(config, dtype=torch.bfloat16)
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in hf.named_buffers()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_families_without_such_buffers_are_left_alone(family: str) -> None:
    model = _params_to_bf16(_fp32_model(family))
    before = {n: b.clone() for n, b in model.named_buffers()}
    cast_buffers_as_hf(model, tiny_config(family), torch.bfloat16)
    for n, b in model.named_buffers():
        assert b.dtype == before[n].dtype and torch.equal(b, before[n]), n


def test_gemma2_embedding_scale_as_hf_and_the_same_in_use() -> None:
    """HF's bf16 Gemma2 holds its embedding scale in bf16; its forward casts the scale to the weight's dtype
    anyway, so the value the embedding multiplies by is unchanged."""
    model = _params_to_bf16(_fp32_model("gemma2"))
    scale = next(b for n, b in model.named_buffers() if n.endswith("embed_scale")).clone()
    assert cast_buffers_as_hf(model, tiny_config("gemma2"), torch.bfloat16) == ["model.embed_tokens.embed_scale"]
    cast = next(b for n, b in model.named_buffers() if n.endswith("embed_scale"))
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, scale.to(torch.bfloat16))


def test_fp32_runs_cast_nothing() -> None:
    model = _fp32_model("minimax")
    assert cast_buffers_as_hf(model, tiny_config("minimax"), torch.float32) == []
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())


def test_minimax_bf16_forward_needs_the_cast() -> None:
    ids = torch.randint(0, tiny_config("minimax").vocab_size, (2, 16))
    params_only = _params_to_bf16(_fp32_model("minimax"))
    with pytest.raises(RuntimeError, match="same dtype"):
        params_only(input_ids=ids)
    shadow = bf16_like_deepspeed(_fp32_model("minimax"))  # verify's bf16 shadow: parameters and buffers
    logits = shadow(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
