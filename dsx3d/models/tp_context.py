"""The tensor-parallel coordinates a stage needs, with the process group bound once the groups exist."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TPContext:
    """rank/size are known from the layout before any process group exists; `group` is bound later: with a
    pipeline to DeepSpeed's `PipelineParallelGrid.get_slice_parallel_group()`, without one to the TP group of
    dsx3d.dist.groups.DataTensorParallelGroups (None while size == 1)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, repr=False)

    def bind(self, group: Any) -> None:
        if self.size > 1:
            self.group = group

    def chunk_bounds(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's even share of n (n % size == 0, checked by the caller)."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part
