"""What dsx3d reads off Hugging Face modules by their attributes, imported by every layer (it imports nothing of
dsx3d): which submodules of a decoder layer are attention, and their head size."""

from __future__ import annotations

from torch import nn


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The HF attention modules of a decoder layer: those that dispatch through `config._attn_implementation`
    with per-head shapes (q/k/v projections viewed as (..., heads, head_dim))."""
    return [m for m in layer.modules() if hasattr(m, "config") and hasattr(m, "scaling") and head_dim(m)]


def head_dim(attn: nn.Module) -> int:
    return int(getattr(attn, "head_dim", None) or getattr(attn, "head_size", None) or 0)
