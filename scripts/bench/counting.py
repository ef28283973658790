"""Count what this process hands to torch.distributed: every collective and point-to-point call, with the
ranks of its group and its buffer size (benchmarks and tests; nothing in training uses it).

The hook sits on `ProcessGroup`'s methods (allreduce, send, all_gather_single, ...), the layer every
torch.distributed function ends in, so it sees DeepSpeed's calls too, whichever function object DeepSpeed
cached at start-up. It does not see what C++ calls directly (DDP's reducer).

Buffer bytes per call (`CommRecord.nbytes`): all-reduce, broadcast, reduce, send and recv the tensor;
all-gather the gathered output (group size x input); reduce-scatter the input being scattered; all-to-all the
input, of which `local_bytes` stay on this rank (its own split). `sent_bytes` turns a record into the bytes
one rank sends with ring algorithms, the unit of `dsx3d.estimate`: all-reduce 2(g-1)/g of the buffer,
all-gather and reduce-scatter (g-1)/g, all-to-all what goes to other ranks, send all of it, recv nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_PG = dist.ProcessGroup


@dataclass(frozen=True)
class CommRecord:
    op: str
    """"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send", "recv", "barrier", ..."""
    ranks: tuple[int, ...]
    """Global ranks of the group; for send/recv (this rank, peer) as global ranks."""
    nbytes: int
    local_bytes: int | None = None
    """all-to-all: bytes of the input this rank sends to itself (None: assume an even split)."""

    @property
    def group_size(self) -> int:
        return len(self.ranks)

    def sent_bytes(self) -> float:
        """Bytes this rank sends, counted as ring algorithms move them (module docstring)."""
        g = self.group_size
        if self.op == "send":
            return float(self.nbytes)
        if g <= 1 or self.op in ("recv", "barrier"):
            return 0.0
        if self.op == "all_reduce":
            return 2 * (g - 1) / g * self.nbytes
        if self.op == "all_to_all" and self.local_bytes is not None:
            return float(self.nbytes - self.local_bytes)
        if self.op in ("all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"):
            return (g - 1) / g * self.nbytes
        return float(self.nbytes)


def _bytes(obj: Any) -> int:
    """Bytes of a tensor or of (nested) lists of tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_bytes(x) for x in obj)
    return 0


# ProcessGroup method -> (op name, how to size the call from its positional arguments)
_METHODS: dict[str, tuple[str, Callable[[tuple], int]]] = {
    "allreduce": ("all_reduce", lambda a: _bytes(a[0])),
    "allreduce_coalesced": ("all_reduce", lambda a: _bytes(a[0])),
    "broadcast": ("broadcast", lambda a: _bytes(a[0])),
    "reduce": ("reduce", lambda a: _bytes(a[0])),
    "allgather": ("all_gather", lambda a: _bytes(a[0])),
    "all_gather_single": ("all_gather", lambda a: _bytes(a[0])),
    "_allgather_base": ("all_gather", lambda a: _bytes(a[0])),
    "allgather_coalesced": ("all_gather", lambda a: _bytes(a[0])),
    "allgather_into_tensor_coalesced": ("all_gather", lambda a: _bytes(a[0])),
    "reduce_scatter": ("reduce_scatter", lambda a: _bytes(a[1])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _bytes(a[1])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _bytes(a[1])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _bytes(a[1])),
    "alltoall": ("all_to_all", lambda a: _bytes(a[1])),
    "alltoall_base": ("all_to_all", lambda a: _bytes(a[1])),
    "all_to_all_single": ("all_to_all", lambda a: _bytes(a[1])),
    "send": ("send", lambda a: _bytes(a[0])),
    "recv": ("recv", lambda a: _bytes(a[0])),
    "barrier": ("barrier", lambda a: 0),
}


def _local_split_bytes(pg: Any, args: tuple) -> int | None:
    """alltoall_base(output, input, output_splits, input_splits): the rows of the input this rank keeps."""
    if len(args) < 4 or not isinstance(args[1], torch.Tensor):
        return None
    tensor, splits, me = args[1], list(args[3]), pg.rank()
    row = tensor[0].numel() * tensor.element_size() if tensor.dim() and tensor.shape[0] else 0
    if not splits:  # even split
        return tensor.numel() * tensor.element_size() // max(pg.size(), 1)
    return int(splits[me]) * row


def _group_ranks(pg: Any) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:  # a group unknown to the c10d registry (should not happen): fall back to its size
        return tuple(range(pg.size()))


class CommCounter:
    """While active (`with counter:`), appends a `CommRecord` for every ProcessGroup call of this process.
    `records` can be cleared between phases (e.g. to drop a warm-up step)."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, op: str, size: Callable[[tuple], int]) -> Callable[..., Any]:
        original = getattr(_PG, name)  # callable as original(pg, *args)

        def wrapper(pg: Any, *args: Any, **kwargs: Any) -> Any:
            ranks = _group_ranks(pg)
            if op in ("send", "recv") and len(args) >= 2:
                # send/recv take a group-local peer rank; record (this rank, peer) globally
                ranks = (dist.get_rank(), ranks[int(args[1])])
            local = _local_split_bytes(pg, args) if op == "all_to_all" else None
            self.records.append(CommRecord(op, ranks, size(args), local))
            return original(pg, *args, **kwargs)

        return wrapper

    def __enter__(self) -> CommCounter:
        for name, (op, size) in _METHODS.items():
            if name in vars(_PG):
                # keep the class's own descriptor: restoring what getattr returns would lose the self binding
                self._saved[name] = vars(_PG)[name]
                setattr(_PG, name, self._wrap(name, op, size))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(_PG, name, original)
        self._saved.clear()


@contextlib.contextmanager
def count_comm() -> Iterator[CommCounter]:
    """`with count_comm() as counter: ...` then read `counter.records`."""
    with CommCounter() as counter:
        yield counter
