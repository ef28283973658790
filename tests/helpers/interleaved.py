"""A tiny Llama cut into looped pipeline stages for interleaved 1F1B's tests (no DeepSpeed)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from dsx3d.models.known_families import tiny_config


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def stage_forward(model: torch.nn.Module, s: int, stages: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Stage s of `stages`: the embedding on stage 0, decoder layer(s) spread evenly, norm + head + loss last."""
    inner = model.model
    layers = len(inner.layers)
    h = inner.embed_tokens(x) if s == 0 else x
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    cos_sin = inner.rotary_emb(h, pos)
    for i in range(s * layers // stages, (s + 1) * layers // stages):
        out = inner.layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        h = out[0] if isinstance(out, tuple) else out
    if s < stages - 1:
        return h
    logits = model.lm_head(inner.norm(h))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def reference(model: torch.nn.Module, micro: list[torch.Tensor]) -> float:
    """One plain HF forward and backward of loss / m per micro-batch; the mean loss."""
    total = 0.0
    for ids in micro:
        loss = model(input_ids=ids, labels=ids).loss
        (loss / len(micro)).backward()
        total += float(loss.detach())
    return total / len(micro)
