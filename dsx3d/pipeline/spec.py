"""What a pipeline schedule tells the rest of dsx3d (`ScheduleSpec`); `dsx3d.pipeline.registry` lists them."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsx3d.boundary_types import HFConfig, PipeEngine
    from dsx3d.errors import Problem
    from dsx3d.recipe.schema import Recipe

Ratios = tuple[float, float, float]
"""Relative durations of a micro-batch's forward (F), input-gradient (B) and weight-gradient (W) passes."""


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    summary: str
    """One line for `--help` texts and the docs."""
    pipeline_units: Callable[[int, int, Ratios | None], float]
    """(pp, micro-batches, F/B/W costs) -> a step's pipeline time in micro-batch times of the slowest stage."""
    held_micro_batches: Callable[[int, int, int, Ratios | None], int]
    """(stage, pp, micro-batches, costs) -> micro-batches whose activations `stage` holds at its peak."""
    problems: Callable[[Recipe, HFConfig | None], Iterator[Problem]]
    """The checker's rules for a recipe that names this schedule (`dsx3d.checks.schedule`)."""
    measured_costs: bool = False
    """Whether `parallel.zb_costs: auto` (F, B and W timed in the run) means anything to it."""
    with_activation_checkpointing: bool = True
    """Whether the planner may pair it with `train.activation_checkpointing`."""
    idle: Callable[[int, int, Ratios | None], float] | None = None
    """(pp, micro-batches, costs) -> the idle fraction, where a closed form is exact; else 1 - m / units."""
    virtual_stages: int = 1
    """Model chunks per rank it runs (`parallel.virtual_stages`): > 1 for interleaved schedules, whose step model
    and held micro-batches are for that many."""
    placement: str = "looped"
    """How a rank's chunks are placed (`dsx3d.pipeline.split.stage_of`): "looped" (chunk c of rank r is stage
    c p + r) or "v" (rank r holds stages r and 2p - 1 - r)."""
    installer: str | None = None
    """"module:function" taking (engine, recipe) that installs it into a PipelineEngine; None: DeepSpeed's own
    `TrainSchedule` runs."""

    def bubble(self, pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
        """Idle fraction of balanced stages."""
        if self.idle is not None:
            return self.idle(pp, micro_batches, costs)
        return 1 - micro_batches / self.pipeline_units(pp, micro_batches, costs)

    def install(self, engine: PipeEngine, recipe: Recipe) -> None:
        if self.installer is None:
            return
        module, function = self.installer.split(":")
        getattr(importlib.import_module(module), function)(engine, recipe)
