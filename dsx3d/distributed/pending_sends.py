"""Pipeline sends that do not wait for the receiver.

A gloo send returns only once the receiving rank has posted the matching receive. Under a schedule whose
stages send at other moments than their neighbours receive (zero bubble: a stage may be in a W pass when
its neighbour sends), a blocking send idles the sender for that whole time. `PendingSends.posting(p2p)`
turns DeepSpeed's `p2p.send` into a posted send for the duration of one instruction; the sent tensors are
kept alive until `wait()`, which the schedule calls before the gradient reduce (every send of the step has
found its receive by the time the neighbour finishes its own schedule). Sends to one peer keep their order,
as receives do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class PendingSends:
    def __init__(self) -> None:
        self.works: list[tuple[Any, torch.Tensor]] = []

    @contextlib.contextmanager
    def posting(self, p2p: Any) -> Iterator[None]:
        """Within the block, `p2p.send(tensor, dest_stage)` (DeepSpeed's pipe p2p module) posts the send."""
        blocking = p2p.send

        def send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> None:
            rank = p2p._grid.stage_to_global(stage_id=dest_stage)
            self.works = [(w, t) for w, t in self.works if not w.is_completed()]  # their tensors may go
            self.works.append((dist.isend(tensor, rank), tensor))

        p2p.send = send
        try:
            yield
        finally:
            p2p.send = blocking

    def wait(self) -> int:
        """Wait for every posted send; the number waited for."""
        works, self.works = self.works, []
        for work, _ in works:
            work.wait()
        return len(works)
