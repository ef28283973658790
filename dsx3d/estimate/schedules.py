"""What the pipeline schedule (`parallel.schedule`) changes in the estimate: the step's length in micro-batch
times, its idle fraction, and how many micro-batches a stage holds activations for. Each schedule's model is
its entry in `dsx3d.pipeline.registry` (1F1B: m + p - 1 and min(p - s, m); zb-h1: its simulated order), except
interleaved 1F1B's, which `dsx3d.estimate.interleaved` models for any v with the published activation count
(Korthikanti et al.; the engine runs any v >= 2); ZB-2p, `dsx3d.estimate.zero_bubble`, is ESTIMATOR ONLY (the engine does not run it):
`runnable` says which a planner may pick."""

from __future__ import annotations

from dsx3d.estimate import interleaved, zero_bubble
from dsx3d.pipeline.registry import SCHEDULE_NAMES, get_schedule
from dsx3d.pipeline.spec import Ratios

ESTIMATOR_ONLY: tuple[str, ...] = tuple(n for n in (interleaved.NAME, zero_bubble.NAME) if n not in SCHEDULE_NAMES)
"""Schedules the estimator models but the engine does not run (not in the registry)."""
ESTIMATED_SCHEDULES: tuple[str, ...] = SCHEDULE_NAMES + ESTIMATOR_ONLY
"""Every schedule the estimator and planner can model: the registry's, interleaved 1F1B and ZB-2p."""


def runnable(schedule: str) -> bool:
    """Whether the engine runs `schedule` (the registry has it): only those may a planner pick."""
    return schedule in SCHEDULE_NAMES


def _estimator_only(schedule: str) -> bool:
    return schedule in ESTIMATOR_ONLY


def _chunks(schedule: str, virtual_stages: int) -> int:
    """The caller's v, else (1: not given) the v the registered schedule runs."""
    if virtual_stages > 1 or schedule not in SCHEDULE_NAMES:
        return virtual_stages
    return get_schedule(schedule).virtual_stages


def head_stage(schedule: str, pp: int) -> int:
    """The pipeline rank that runs the final norm, the head and the loss: the last, or rank 0 where the schedule
    places its two chunks in a V (zb-v: rank 0 holds the first and the last stage)."""
    if schedule in SCHEDULE_NAMES and get_schedule(schedule).placement == "v":
        return 0
    return pp - 1


def rank_layers(schedule: str, stage_split: list[int], pp: int) -> list[int]:
    """Decoder layers per rank from the split over the schedule's stages: one stage per rank, or (V-shaped) the
    2 pp stages folded, rank r holding stages r and 2 pp - 1 - r. Looped chunks keep the per-rank split."""
    if len(stage_split) == 2 * pp and head_stage(schedule, pp) == 0:
        return [stage_split[r] + stage_split[2 * pp - 1 - r] for r in range(pp)]
    return stage_split


def pipeline_units(
    schedule: str, pp: int, micro_batches: int, costs: Ratios | None = None, virtual_stages: int = 1
) -> float:
    """A step's pipeline time in micro-batch times of the slowest stage."""
    if schedule == zero_bubble.NAME and _estimator_only(schedule):
        return zero_bubble.pipeline_units(pp, micro_batches, costs)
    if schedule == interleaved.NAME:
        return interleaved.pipeline_units(pp, micro_batches, _chunks(schedule, virtual_stages))
    return get_schedule(schedule).pipeline_units(pp, micro_batches, costs)


def schedule_bubble(
    schedule: str, pp: int, micro_batches: int, costs: Ratios | None = None, virtual_stages: int = 1
) -> float:
    """Idle fraction of balanced stages."""
    if schedule == zero_bubble.NAME and _estimator_only(schedule):
        return zero_bubble.bubble(pp, micro_batches, costs)
    if schedule == interleaved.NAME:
        return interleaved.bubble(pp, micro_batches, _chunks(schedule, virtual_stages))
    return get_schedule(schedule).bubble(pp, micro_batches, costs)


def held_micro_batches(
    schedule: str, stage: int, pp: int, micro_batches: int, costs: Ratios | None = None, virtual_stages: int = 1
) -> int:
    """Micro-batches whose activations `stage` holds at its peak."""
    if schedule == zero_bubble.NAME and _estimator_only(schedule):
        return zero_bubble.held_micro_batches(stage, pp, micro_batches)
    if schedule == interleaved.NAME:
        return interleaved.held_micro_batches(stage, pp, micro_batches, _chunks(schedule, virtual_stages))
    return get_schedule(schedule).held_micro_batches(stage, pp, micro_batches, costs)
