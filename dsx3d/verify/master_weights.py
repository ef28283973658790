"""The 3D side's fp32 master weights, as `dsx3d verify` compares them in bf16.

A bf16 engine computes with bf16 parameters but keeps an fp32 master copy in its optimizer (DeepSpeed's
BF16_Optimizer, the fp32 partitions of ZeRO 1-3, or, without ZeRO on the regular engine, the fp32 copies of
the fp16 wrapper that drives bf16 there) and applies every update there. The bf16 parameters
are that copy rounded to 8 significant bits: a norm weight of 1.0 is stored to within 2^-8, so an SGD step
that moves it by less than that (a q/k norm's gradient at verify's learning rate) is invisible in them. The
masters hold W - lr x g to fp32's spacing, so verify's SGD run reads the gradient the engine applied from
them, with fp32's resolution; what bf16 computes differently is then left to the bf16 allowance alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsx3d.models.shards import Shard
from dsx3d.models.weights import shard_of

if TYPE_CHECKING:
    from dsx3d.engine import Engine3D


def master_shards(engine: Engine3D) -> dict[str, Shard]:
    """{hf name: (fp32 master tensor, TP dim, tp rank)} of this rank's parameters, as `Engine3D.hf_shards`
    but read from the optimizer's fp32 copy (a frozen parameter, which has none, as it is stored). Every rank
    of a DP group reads the same parameters in the same order: each read is a collective over that group."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    copies = _wrapper_masters(engine)
    masters = [(safe_get_full_fp32_param(p) if p.requires_grad else None) for p in params]
    masters = [copies.get(id(p)) if m is None and p.requires_grad else m for p, m in zip(params, masters, strict=True)]
    out: dict[str, Shard] = {}
    with engine.gathered(params):
        for p, master in zip(params, masters, strict=True):
            name = getattr(p, "hf_name", None)
            if name is None or name in out:
                continue
            dim, index = shard_of(p, engine.placement.tp) or (None, engine.placement.tp)
            value = p.detach() if master is None else master.detach().reshape(p.shape)
            out[name] = (value.float().clone(), dim, index)
    return out


def _wrapper_masters(engine: Engine3D) -> dict[int, torch.Tensor]:
    """{id(parameter): fp32 copy} of DeepSpeed's fp16 wrappers, FP16_UnfusedOptimizer (`fp32_groups`, one
    tensor per parameter) and FP16_Optimizer (`fp32_groups_flat`, one flat tensor per group), which also drive
    bf16 without ZeRO on the regular engine: they keep no `_hp_mapping`, so `safe_get_full_fp32_param` returns
    None for their parameters, and the bf16 parameters alone would put 2^-8 of every weight into its update.
    Empty for the other optimizers."""
    from torch._utils import _unflatten_dense_tensors

    optimizer = engine.ds_engine.optimizer
    low = getattr(optimizer, "fp16_groups", None)
    flat = getattr(optimizer, "fp32_groups_flat", None)
    high = getattr(optimizer, "fp32_groups", None)
    if low is None:
        return {}
    if flat is not None:
        high = [_unflatten_dense_tensors(f, group) for f, group in zip(flat, low, strict=True)]
    if high is None:
        return {}
    return {id(p): m for group, copies in zip(low, high, strict=True) for p, m in zip(group, copies, strict=True)}
