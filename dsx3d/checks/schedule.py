"""Checker rules for `parallel.schedule` (the pipeline schedule): each schedule's own rules come from its entry
in `dsx3d.pipeline.registry`; `parallel.zb_costs: auto` needs a schedule that times its passes; `parallel.virtual_stages` > 1 needs a schedule
that runs chunks."""

from __future__ import annotations

from collections.abc import Iterator

from dsx3d.boundary_types import HFConfig
from dsx3d.errors import Problem
from dsx3d.pipeline.interleaved import virtual_stage_problems
from dsx3d.pipeline.registry import get_schedule, measured_cost_schedules
from dsx3d.recipe.schema import Recipe


def schedule_problems(recipe: Recipe, hf_config: HFConfig | None) -> Iterator[Problem]:
    spec = get_schedule(recipe.parallel.schedule)
    if recipe.parallel.zb_costs == "auto" and not spec.measured_costs:
        timed = ", ".join(measured_cost_schedules())
        yield Problem(
            "parallel.zb_costs",
            "auto",
            f"auto times the F, B and W passes that {timed} runs separately, to order them; "
            f"parallel.schedule {spec.name} runs DeepSpeed's fused backward, which has no B and "
            "W passes to measure and no order to build",
            f"set parallel.schedule: {timed}, or remove parallel.zb_costs",
        )
    yield from virtual_stage_problems(recipe, spec.virtual_stages)
    yield from spec.problems(recipe, hf_config)
