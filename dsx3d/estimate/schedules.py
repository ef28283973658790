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
    """(pipeline time in micro-batch times, peak micro-batches held per stage) of the cost-aware order.
    Past a warm-up of 8 pp micro-batches the order (nearly) repeats every pp micro-batches, so long
    accumulations are extrapolated from two simulated lengths pp apart with the same remainder, instead of
    simulated whole (a planner's 70B candidates reach hundreds of micro-batches); an estimate, within a few
    percent where the greedy order is not exactly periodic."""
    base = 8 * pp + (micro_batches - 8 * pp) % pp  # the same remainder modulo pp as micro_batches
    if micro_batches > base + pp:
        units_a, held = _zb(pp, base, costs)
        units_b, _ = _zb(pp, base + pp, costs)
        return units_b + (units_b - units_a) / pp * (micro_batches - base - pp), held
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
