"""`engine.load_checkpoint` that also restores BF16_Optimizer's states when ZeRO is off.

With bf16, a pipeline and no ZeRO, DeepSpeed picks BF16_Optimizer (runtime/engine.py,
`_do_optimizer_sanity_check`). That optimizer splits its fp32 master weights and moments over the
data-parallel group, and the engine saves each rank's part in its own `bf16_zero_pp_rank_*` file, as under
ZeRO-1. Loading does not mirror that: the engine reads those files only when ZeRO is enabled, and otherwise
hands the model-states file's single `optimizer` entry (one rank's state, a mapping) to
`BF16_Optimizer.load_state_dict`, which indexes a per-rank list and fails (KeyError 0).

So for that optimizer the engine loads everything but the optimizer, then the per-rank files are read with
the engine's own ZeRO reader, exactly as it does under ZeRO-1 with the same optimizer class. Every other
optimizer goes through `engine.load_checkpoint` unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from dsx3d.boundary_types import DSEngine


def needs_partitioned_load(ds_engine: DSEngine) -> bool:
    """Whether the engine's optimizer keeps per-rank partitions that its own load skips (BF16_Optimizer
    without ZeRO)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(ds_engine.optimizer, BF16_Optimizer) and not ds_engine.zero_optimization()


def load_checkpoint(ds_engine: DSEngine, load_dir: str, tag: str | None = None, **kwargs: object) -> tuple[Any, Any]:
    """`ds_engine.load_checkpoint(load_dir, tag, **kwargs)`, restoring BF16_Optimizer's partitions without
    ZeRO from the per-rank files the engine wrote."""
    load_optimizer = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
    if not (load_optimizer and needs_partitioned_load(ds_engine)):
        return ds_engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    path, client = ds_engine.load_checkpoint(load_dir, tag=tag, **{**kwargs, "load_optimizer_states": False})
    if path is None:
        return path, client
    loaded_tag = tag if tag is not None else os.path.basename(os.path.dirname(path))
    if not ds_engine._load_zero_checkpoint(load_dir, loaded_tag, load_optimizer_states=True):
        raise FileNotFoundError(f"no bf16_zero_pp_rank_* optimizer files under {os.path.join(load_dir, loaded_tag)}")
    if ds_engine.load_universal_checkpoint():
        ds_engine.optimizer.update_lp_params()  # universal loads take the weights from the optimizer's copy
    if client is not None:
        client.pop("optimizer", None)
    return path, client
