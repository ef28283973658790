"""This rank's parameters under their Hugging Face names, and merging the TP shards of all ranks back."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Shard = tuple[torch.Tensor, int | None, int]  # (tensor, partition dim or None, tp rank)


def local_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The shape of this rank's (TP shard of a) parameter, also while ZeRO-3 has partitioned it over DP (its
    data then is an empty placeholder and `ds_shape` keeps the real shape)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def local_hf_shards(module: nn.Module, tp_rank: int) -> dict[str, Shard]:
    """{hf_name: (tensor, dim, tp_rank)} for every parameter this rank owns (materialize() names them)."""
    out: dict[str, Shard] = {}
    for p in module.parameters():
        name = getattr(p, "hf_name", None)
        if name is not None and name not in out:
            dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
            out[name] = (p.detach().float().clone(), dim, tp_rank)
    return out


def merge_shards(per_rank: list[dict[str, Shard]], sizes: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards: TP shards concatenated in tp order along their dim and trimmed
    to the real size (vocab padding removed); replicated tensors taken once."""
    sizes = sizes or {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for shards in per_rank:
        for name, (tensor, dim, tp_rank) in shards.items():
            pieces.setdefault(name, {})[tp_rank if dim is not None else 0] = tensor
            dims[name] = dim
    full: dict[str, torch.Tensor] = {}
    for name, parts in pieces.items():
        dim = dims[name]
        if dim is None:
            full[name] = parts[0]
            continue
        t = torch.cat([parts[r] for r in sorted(parts)], dim=dim)
        if name in sizes:
            t = t.narrow(dim, 0, sizes[name])
        full[name] = t
    return full
