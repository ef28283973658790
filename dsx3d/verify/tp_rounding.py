"""The bf16 shadow rounds where a tensor-parallel run rounds: each partial sum a TP reduction adds.

`dsx3d.verify.bf16_roundoff` takes the parallel run's bf16 round-off as another draw of the single-process
shadow's. Under TP that draw is not the same size: a row-parallel linear computes tp partial products, each
rounded to bf16, and their all-reduce rounds each sum again, where one process rounds the whole product once;
a column-parallel linear's input gradient (and the vocab-parallel head's) is such a sum in the backward. So
with tp > 1 the shadow computes those linears the same way, piece by piece on the TP ranks' slices, with the
pieces summed in bf16 (by autograd, for the input gradients). The pieces compute what the unsplit linear
computes: in fp32 the reference and this shadow agree to round-off.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from dsx3d.models.family_spec import resolve_family
from dsx3d.models.tp_plan import plan_modules


def _pieces(n: int, tp: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges TP ranks hold of n features: equal pieces of n rounded up to a multiple of
    tp (the vocabulary's padding), cut at n."""
    size = -(-n // tp)
    return [(r * size, min((r + 1) * size, n)) for r in range(tp) if r * size < n]


def _row_forward(linear: nn.Linear, tp: int, x: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor | None = None
    for lo, hi in _pieces(linear.in_features, tp):
        part = F.linear(x[..., lo:hi], linear.weight[:, lo:hi])
        y = part if y is None else y + part
    assert y is not None
    return y if linear.bias is None else y + linear.bias


def _column_forward(linear: nn.Linear, tp: int, x: torch.Tensor) -> torch.Tensor:
    parts = [
        F.linear(x, linear.weight[lo:hi], None if linear.bias is None else linear.bias[lo:hi])
        for lo, hi in _pieces(linear.out_features, tp)
    ]
    return torch.cat(parts, dim=-1)


def round_as_tp(model: nn.Module, config: PretrainedConfig, tp: int) -> int:
    """Make `model` (an HF CausalLM, or a PEFT model around one; in place) compute its TP-sharded linears piece
    by piece as a tp-way run does; returns how many it changed. A linear PEFT wrapped (a LoRA target) is no
    longer a plain linear: it is left whole."""
    if tp <= 1:
        return 0
    spec = resolve_family(config)
    unwrap = getattr(model, "get_base_model", None)  # PEFT's: the CausalLM with the adapters injected
    lm = unwrap() if callable(unwrap) else model
    base = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module):
        return 0
    changed = 0
    for i, layer in enumerate(base.get_submodule(spec.layers_name).children()):
        rel = f"{spec.layers_name}.{i}"
        for _, sub, sharding in plan_modules(layer, rel, spec.tp_plan, lambda m: isinstance(m, nn.Linear)):
            if sharding.row or sharding.column:
                forward = _row_forward if sharding.row else _column_forward
                sub.forward = functools.partial(forward, sub, tp)  # type: ignore[method-assign]
                changed += 1
    head = getattr(lm, spec.head_name, None)
    if isinstance(head, nn.Linear):  # vocab-parallel: rows split over TP, the input gradient summed
        head.forward = functools.partial(_column_forward, head, tp)  # type: ignore[method-assign]
        changed += 1
    return changed
