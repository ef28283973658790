"""What the pipeline schedule (`parallel.schedule`) changes in the estimate: the step's length in micro-batch
times, its idle fraction, and how many micro-batches a stage holds activations for.

1F1B: (m + p - 1) micro-batch times; stage s holds min(p - s, m). zb-h1: the simulated length of the order the
engine runs (`dsx3d.models.zb_greedy`, built for the relative F, B and W durations `costs`; equal by default:
each costs 2N FLOPs per token, the forward, the input gradient and the weight gradients of the matrix
products), in micro-batch times of F + B + W; stage s holds the order's peak of micro-batches between their F
and W, at most min(p, m): the most 1F1B's first stage holds.
"""

from __future__ import annotations

import functools

from dsx3d.models import zb_greedy
from dsx3d.plan.layout import bubble_fraction

SCHEDULES = ("1f1b", "zb-h1")
Ratios = tuple[float, float, float]
EQUAL: Ratios = (1.0, 1.0, 1.0)


@functools.lru_cache(maxsize=1024)
def _zb(pp: int, micro_batches: int, costs: Ratios) -> tuple[float, tuple[int, ...]]:
    plan = zb_greedy.best_plan(pp, micro_batches, zb_greedy.Costs.uniform(pp, *costs))
    rows = [list(row) for row in plan]
    return zb_greedy.makespan(rows) / sum(costs), tuple(zb_greedy.peak_in_flight(rows, s) for s in range(pp))


def pipeline_units(schedule: str, pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    """A step's pipeline time in micro-batch times of the slowest stage."""
    if schedule == "zb-h1" and pp > 1:
        return _zb(pp, micro_batches, tuple(costs or EQUAL))[0]  # type: ignore[arg-type]
    return micro_batches + pp - 1


def schedule_bubble(schedule: str, pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    """Idle fraction of balanced stages."""
    if schedule == "zb-h1" and pp > 1:
        return 1 - micro_batches / pipeline_units(schedule, pp, micro_batches, costs)
    return bubble_fraction(pp, micro_batches)


def held_micro_batches(schedule: str, stage: int, pp: int, micro_batches: int, costs: Ratios | None = None) -> int:
    """Micro-batches whose activations `stage` holds at its peak."""
    if schedule == "zb-h1" and pp > 1:
        return _zb(pp, micro_batches, tuple(costs or EQUAL))[1][stage]  # type: ignore[arg-type]
    return min(pp - stage, micro_batches)
