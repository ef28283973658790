"""Process-group set-up and the few collectives dsx3d calls outside autograd."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from datetime import timedelta
from typing import TypeVar, cast

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

T = TypeVar("T")

def skip_cpu_shm_build() -> None:
    """On a CPU accelerator, DeepSpeed's shared-memory op is not built (listed in dsx3d.integrations.patches)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
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


    skip_cpu_shm_build()  # DeepSpeed's CPU shared-memory op: minutes of JIT build that training never uses
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


def new_group(ranks: list[int]) -> ProcessGroup:
    """A process group over `ranks` (every rank of the world must call this, in the same order)."""
    return dist.new_group(ranks)


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


def broadcast_object(obj: T, src: int = 0) -> T:
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's `obj`, in rank order (small picklable objects: metadata, not tensors)."""
    if not is_initialized():
        return [obj]
    out: list[object] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return cast("list[T]", out)


def gather_to(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> list[torch.Tensor] | None:
    """`tensor` from every rank of `group`, in group-rank order, on global rank `dst`; None elsewhere.
    Every rank sends a tensor of the same shape and dtype."""
    if not is_initialized():
        return [tensor]
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] if dist.get_rank() == dst else None
    dist.gather(tensor, parts, dst=dst, group=group)
    return parts


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


def destroy_at_exit() -> None:
    """Destroy the process group when the interpreter exits normally, while it is still whole (an atexit
    handler; registering again replaces the earlier registration).

    Left to the interpreter's finalization, gloo's worker threads can still release tensors that hold Python
    objects; taking the GIL then ends such a thread, and the unwinding through gloo's C++ aborts the rank with
    "terminate called without an active exception" (exit -6), after the script's last line ran (seen at the end
    of two of 20 resumed runs of the Trainer face's sigterm-twice trials). `dsx3d train` needs no handler: it
    leaves with os._exit. Scripts under a launcher (the Trainer, accelerate) end through the interpreter."""
    atexit.unregister(_destroy_quietly)
    atexit.register(_destroy_quietly)


def _destroy_quietly() -> None:
    try:
        destroy()
    except Exception as err:  # noqa: BLE001 - at exit: a peer may be gone; nothing is left to protect
        logging.getLogger(__name__).debug("process group not destroyed at exit: %s", err)


def get_backend() -> str:
    """The process group's backend ("gloo", "nccl", ...); call after init_distributed."""
    return str(dist.get_backend())


def init_single_process(workdir: str, timeout_s: float = 600.0) -> None:
    """A one-rank process group over a file store in `workdir`, for a script run without a launcher."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    init_distributed(init_method=f"file://{workdir}/store", rank=0, world_size=1, timeout_s=timeout_s)
