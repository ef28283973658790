"""`parallel.zb_costs: auto`: zb-h1's cost-aware order built from F, B and W durations measured in the engine.

The first training step runs the order for equal costs untimed (it allocates the pipeline's buffers and
exchanges tensor shapes, so its passes take longer than later ones); the next `TIMED_STEPS`
also run it, timed by a `StageClock` on the engine. Before the step after them every rank reduces its
stage's median F, B and W busy times (over all timed micro-batches: one step alone is at the mercy of
whatever else the machine runs) over the whole world (the ranks of one stage, its data- and
tensor-parallel replicas, are averaged), so that every rank holds the same per-stage costs and builds the
same order; from then on the clock is off and the order is the one `zb_greedy` builds for those costs
(per stage: a slower stage, the head's, is planned as slower). Measured once: later steps have the same
shapes, so the same durations; re-measuring would cost a collective per step and could make ranks
switch orders at different steps if they did not all re-measure together.
"""

from __future__ import annotations

import torch

from dsx3d.boundary_types import PipeEngine
from dsx3d.distributed import comm
from dsx3d.pipeline import zb_greedy
from dsx3d.pipeline.stage_clock import StageClock, part_costs


def agree(stage: int, stages: int, local: dict[str, float | None]) -> zb_greedy.Costs:
    """Every rank's per-stage F, B, W seconds, averaged over the ranks of each stage (a collective over the
    world: every rank calls it once, at the same step)."""
    sums = torch.zeros(4, stages, dtype=torch.float64)
    sums[0, stage], sums[1, stage], sums[2, stage] = (float(local[k] or 0.0) for k in ("F", "B", "W"))
    sums[3, stage] = 1.0
    comm.all_reduce_sum(sums)
    mean = sums[:3] / sums[3].clamp(min=1.0)
    if not bool((mean > 0).all()):
        missing = [s for s in range(stages) if not bool((mean[:, s] > 0).all())]
        raise RuntimeError(f"parallel.zb_costs auto: no F, B and W durations were measured on stages {missing}")
    f, b, w = (tuple(float(x) for x in mean[k]) for k in range(3))
    return zb_greedy.Costs(f, b, w)


UNTIMED_STEPS = 1
"""Training steps run before the timed ones."""
TIMED_STEPS = 2
"""Training steps the costs are measured over."""


class MeasuredCosts:
    """Times `TIMED_STEPS` training steps of `engine` after `UNTIMED_STEPS`, then holds the costs all ranks agreed on."""

    def __init__(self, engine: PipeEngine) -> None:
        self.engine = engine
        self.clock: StageClock | None = None
        self.costs: zb_greedy.Costs | None = None
        self._table = engine._INSTRUCTION_MAP
        self._steps = 0

    def before_step(self) -> zb_greedy.Costs | None:
        """The costs for the step about to run: None (equal) until they are measured, then the agreed ones."""
        if self.costs is not None:
            return self.costs
        self._steps += 1
        if self._steps <= UNTIMED_STEPS:
            return None
        if self.clock is None:  # the first timed step
            self._table = self.engine._INSTRUCTION_MAP
            self.clock = StageClock(self.engine)
        if self._steps <= UNTIMED_STEPS + TIMED_STEPS:
            return None
        events = self.clock.take()
        self.engine._INSTRUCTION_MAP = self._table  # the clock is off from here on
        e = self.engine
        self.costs = agree(e.stage_id, e.num_stages, part_costs(events))
        e.dsx3d_zb_costs = self.costs  # type: ignore[attr-defined]
        return self.costs
