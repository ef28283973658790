"""The pipeline schedules dsx3d runs, by name: each entry says what the checker refuses with it, how long a step
is and how many micro-batches a stage holds (the estimator's and planner's model), which options the planner
may combine with it, and how it is installed into DeepSpeed's PipelineEngine.

Pure: the installer is named by its dotted path and imported only when an engine is built, so the recipe
schema, the checker, the estimator and the planner read this table without importing DeepSpeed. Adding a
schedule is one module that defines its `ScheduleSpec`, one line in `_SPECS`, and its parity test
(docs/guide/extending.md).
"""

from __future__ import annotations

from dsx3d.pipeline import interleaved, one_f_one_b, zb_h1, zb_v
from dsx3d.pipeline.spec import ScheduleSpec

_SPECS = (
    one_f_one_b.SPEC,
    zb_h1.SPEC,
    interleaved.SPEC,
    zb_v.SPEC,
)
SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in _SPECS}
DEFAULT_SCHEDULE = one_f_one_b.NAME
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)


def get_schedule(name: str) -> ScheduleSpec:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}") from None


def chunks_for(name: str, given: int | None) -> int:
    """The chunks per rank schedule `name` runs for a recipe whose `parallel.virtual_stages` is `given`: a looped
    schedule of several chunks (interleaved 1F1B) keeps a count of 2 or more that the recipe gives; every other
    schedule runs its own (one chunk, or the V's two). `plan --schedule` and `estimate --schedule` ask this."""
    spec = get_schedule(name)
    if spec.virtual_stages > 1 and spec.placement == "looped" and given is not None and given > 1:
        return given
    return spec.virtual_stages


def measured_cost_schedules() -> tuple[str, ...]:
    return tuple(s.name for s in _SPECS if s.measured_costs)


def planner_options(
    pp: int, default: str, schedules: tuple[str, ...], num_layers: int = 0, micro_batches: int = 0, max_chunks: int = 4
) -> list[tuple[bool, str, int]]:
    """(activation checkpointing, schedule, virtual stages) the planner tries: with pp > 1 each of `schedules`,
    with checkpointing only where the schedule takes it, and a schedule that runs several chunks per rank at
    every v from 2 to `max_chunks` its checker accepts (equal chunks of whole layers: pp x v dividing
    `num_layers`; the micro-batches a multiple of pp), a V-shaped one at its two chunks; with pp = 1 the schedule does not matter (`default`)."""
    if pp == 1:
        return [(False, default, 1), (True, default, 1)]
    out = []
    for ckpt in (False, True):
        for name in schedules:
            spec = get_schedule(name)
            if ckpt and not spec.with_activation_checkpointing:
                continue
            if spec.virtual_stages == 1:
                out.append((ckpt, name, 1))
            elif spec.placement == "v":  # two chunks, any m
                out += [(ckpt, name, spec.virtual_stages)] if num_layers and num_layers % (pp * spec.virtual_stages) == 0 else []
            elif micro_batches % pp == 0:
                out += [(ckpt, name, v) for v in range(2, max_chunks + 1) if num_layers and num_layers % (pp * v) == 0]
    return out
