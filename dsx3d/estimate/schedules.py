"""What the pipeline schedule (`parallel.schedule`) changes in the estimate: the step's length in micro-batch
times, its idle fraction, and how many micro-batches a stage holds activations for.

1F1B: (m + p - 1) micro-batch times; stage s holds min(p - s, m). ZB-H1 (`dsx3d.models.zb_plan`): the length of
its order in ticks of one third of a micro-batch (F, B and W each cost 2N FLOPs per token: the forward, the
input gradient and the weight gradients of the matrix products); stage s holds the order's peak of
micro-batches between their F and W, at most min(p, m): the most 1F1B's first stage holds.
"""

from __future__ import annotations

import functools

from dsx3d.layout import bubble_fraction
from dsx3d.models import zb_plan

SCHEDULES = ("1f1b", "zb-h1")


@functools.lru_cache(maxsize=1024)
def _zb(pp: int, micro_batches: int) -> tuple[int, tuple[int, ...]]:
    ticks = zb_plan.compute_ticks(pp, micro_batches)
    return len(ticks[0]), tuple(zb_plan.peak_in_flight(ticks, s) for s in range(pp))


def pipeline_units(schedule: str, pp: int, micro_batches: int) -> float:
    """A step's pipeline time in micro-batch times of the slowest stage."""
    if schedule == "zb-h1" and pp > 1:
        return _zb(pp, micro_batches)[0] / 3
    return micro_batches + pp - 1


def schedule_bubble(schedule: str, pp: int, micro_batches: int) -> float:
    """Idle fraction of balanced stages."""
    if schedule == "zb-h1" and pp > 1:
        return 1 - micro_batches / pipeline_units(schedule, pp, micro_batches)
    return bubble_fraction(pp, micro_batches)


def held_micro_batches(schedule: str, stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations `stage` holds at its peak."""
    if schedule == "zb-h1" and pp > 1:
        return _zb(pp, micro_batches)[1][stage]
    return min(pp - stage, micro_batches)
