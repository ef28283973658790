"""The tensor-parallel coordinates a stage needs, with the process group bound once the groups exist,
and the two region boundaries every TP layer goes through.

Entering a TP region (Megatron's `f`: the input of column-parallel linears, experts, ...) and leaving it
(`g`: the output of row-parallel linears) are the only places where activations change from replicated to
per-rank and back. Layers call `enter_region` / `exit_region` instead of the raw mappings, so what happens
at a boundary (the collective, the dropout stream) is decided here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dsx3d.distributed.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from dsx3d.distributed.tensor_parallel.random import TPRandom


@dataclass
class TPContext:
    """rank/size are known from the layout before any process group exists; `group` is bound later: with a
    pipeline to DeepSpeed's grid's TP ("slice") group, without one to the TP group of
    dsx3d.distributed.groups.DataTensorParallelGroups (None while size == 1)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, repr=False)
    random: TPRandom = field(default_factory=TPRandom, repr=False)

    def __post_init__(self) -> None:
        self.random.tp_rank = self.rank

    def bind(self, group: Any) -> None:
        if self.size > 1:
            self.group = group

    def chunk_bounds(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's even share of n (n % size == 0, checked by the caller)."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def enter_region(self, x: torch.Tensor, *, training: bool) -> torch.Tensor:
        """Replicated `x` feeds per-rank computation: identity forward, gradient all-reduce backward (f);
        dropout from here on draws this rank's own masks."""
        self.random.enter_sharded(x, training)
        return copy_to_tp(x, self.group)

    def exit_region(self, y: torch.Tensor) -> torch.Tensor:
        """Per-rank partial sums become the replicated result: all-reduce forward, identity backward (g);
        dropout from here on draws the masks every TP rank shares."""
        out = reduce_from_tp(y, self.group)
        self.random.leave_sharded()
        return out

    def close_regions(self) -> None:
        """At the edges of a pipeline item: whatever a layer left open, the replicated stream is back."""
        self.random.leave_sharded()
