"""1F1B, each backward fused (input and weight gradients together), in the order of DeepSpeed's `TrainSchedule`
with each output sent as soon as it is computed, posted (`dsx3d.pipeline.posted_1f1b`).

A step lasts m + p - 1 micro-batch times; stage s holds the activations of min(p - s, m) micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from dsx3d.errors import Problem
from dsx3d.pipeline.spec import Ratios, ScheduleSpec
from dsx3d.plan.layout import bubble_fraction

if TYPE_CHECKING:
    from dsx3d.boundary_types import HFConfig
    from dsx3d.recipe.schema import Recipe

NAME = "1f1b"


def pipeline_units(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    return micro_batches + pp - 1


def held_micro_batches(stage: int, pp: int, micro_batches: int, costs: Ratios | None = None) -> int:
    return min(pp - stage, micro_batches)


def idle(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    return bubble_fraction(pp, micro_batches)


def problems(recipe: Recipe, hf_config: HFConfig | None) -> Iterator[Problem]:
    return iter(())


SPEC = ScheduleSpec(
    name=NAME,
    summary="one forward, one backward (sends posted as soon as each pass ends)",
    pipeline_units=pipeline_units,
    held_micro_batches=held_micro_batches,
    problems=problems,
    idle=idle,
    installer="dsx3d.pipeline.posted_1f1b:install_for_recipe",
)
