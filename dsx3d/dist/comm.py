"""Process-group set-up and the few collectives dsx3d calls outside autograd."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def _skip_cpu_shm_build() -> None:
    """On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op (minutes; concurrent ranks race at link
    time). It only serves inference all-reduce, which training never calls, so we do not build it."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import importlib

        # not `import deepspeed.comm.torch as m`: that resolves to the attribute deepspeed.comm.torch, i.e. torch
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # type: ignore[attr-defined]


def init_distributed(
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Initialise torch.distributed (env:// by default) and hand it to deepspeed.comm."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _skip_cpu_shm_build()
    backend = backend or get_accelerator().communication_backend_name()
    if backend == "ccl":  # DeepSpeed's CPU default needs oneCCL; gloo is always there
        backend = "gloo"
    if not dist.is_initialized():
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        dist.init_process_group(
            backend=backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), verbose=False)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def barrier(group: ProcessGroup | None = None) -> None:
    if is_initialized():
        dist.barrier(group=group)


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum over `group`, outside autograd (gradient hooks, metrics)."""
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast_object(obj: object, src: int = 0) -> object:
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()
