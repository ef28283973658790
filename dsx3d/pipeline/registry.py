"""The pipeline schedules dsx3d runs, by name: each entry says what the checker refuses with it, how long a step
is and how many micro-batches a stage holds (the estimator's and planner's model), which options the planner
may combine with it, and how it is installed into DeepSpeed's PipelineEngine.

Pure: the installer is named by its dotted path and imported only when an engine is built, so the recipe
schema, the checker, the estimator and the planner read this table without importing DeepSpeed. Adding a
schedule is one module that defines its `ScheduleSpec`, one line in `_SPECS`, and its parity test
(docs/guide/extending.md).
"""

from __future__ import annotations

from dsx3d.pipeline import interleaved, one_f_one_b, zb_h1
from dsx3d.pipeline.spec import ScheduleSpec

_SPECS = (
    one_f_one_b.SPEC,
    zb_h1.SPEC,
    interleaved.SPEC,
)
SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in _SPECS}
DEFAULT_SCHEDULE = one_f_one_b.NAME
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)


def get_schedule(name: str) -> ScheduleSpec:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}") from None


def measured_cost_schedules() -> tuple[str, ...]:
    return tuple(s.name for s in _SPECS if s.measured_costs)


def planner_options(pp: int, default: str, schedules: tuple[str, ...]) -> list[tuple[bool, str]]:
    """(activation checkpointing, schedule) pairs the planner tries: with pp > 1 each of `schedules`, with
    checkpointing only where the schedule takes it; with pp = 1 the schedule does not matter (`default`). Schedules
    that run several chunks per rank are left out: the planner's candidates hold one stage per rank."""
    if pp == 1:
        return [(False, default), (True, default)]
    single = [s for s in schedules if get_schedule(s).virtual_stages == 1]
    return [(ckpt, s) for ckpt in (False, True) for s in single if not ckpt or get_schedule(s).with_activation_checkpointing]

