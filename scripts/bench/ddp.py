"""torch's DistributedDataParallel behind the dist boundary (the benchmarks compare dsx3d against it)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(module: torch.nn.Module, **kwargs: object) -> DistributedDataParallel:
    """DDP over the default process group (initialised by dsx3d.distributed.comm.init_distributed)."""
    return DistributedDataParallel(module, **kwargs)  # type: ignore[arg-type]
