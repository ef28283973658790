"""This rank's parameters under their Hugging Face names, and merging the TP shards of all ranks back."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsx3d.models.weights import shard_of

Shard = tuple[torch.Tensor, int | None, int]  # (tensor, partition dim or None, index along it)


def local_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The shape of this rank's (TP shard of a) parameter, also while ZeRO-3 has partitioned it over DP (its
    data then is an empty placeholder and `ds_shape` keeps the real shape)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def local_hf_shards(module: nn.Module, tp_rank: int) -> dict[str, Shard]:
    """{hf_name: (tensor, dim, index)} for every parameter this rank owns (materialize() names them): the
    index of a TP shard is its TP rank, of an expert shard its slot over ep x tp."""
    out: dict[str, Shard] = {}
    for p in module.parameters():
        name = getattr(p, "hf_name", None)
        if name is not None and name not in out:
            dim, index = shard_of(p, tp_rank) or (None, tp_rank)
            out[name] = (p.detach().float().clone(), dim, index)
    return out


def merge_shards(per_rank: list[dict[str, Shard]], sizes: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards: shards concatenated in index order along their dim and trimmed
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
