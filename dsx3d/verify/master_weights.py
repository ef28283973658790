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

from dsx3d.engine.fp16_wrapper_state import wrapper_masters
from dsx3d.models.shards import Shard
from dsx3d.models.weights import shard_of

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D


def master_shards(engine: Engine3D) -> dict[str, Shard]:
    """{hf name: (fp32 master tensor, TP dim, tp rank)} of this rank's parameters, as `Engine3D.hf_shards`
    but read from the optimizer's fp32 copy (a frozen parameter, which has none, as it is stored). Every rank
    of a DP group reads the same parameters in the same order: each read is a collective over that group."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    # DeepSpeed's fp16 wrappers (bf16 without ZeRO on the regular engine) keep no `_hp_mapping`, so
    # `safe_get_full_fp32_param` returns None for their parameters: their own fp32 copies, else the bf16
    # parameters alone would put 2^-8 of every weight into its update
    copies = {id(p): m for p, m in wrapper_masters(engine.ds_engine.optimizer)}

    def fp32(p: torch.nn.Parameter) -> torch.Tensor | None:
        master = safe_get_full_fp32_param(p)
        return copies.get(id(p)) if master is None else master

    masters = [fp32(p) if p.requires_grad else None for p in params]
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
