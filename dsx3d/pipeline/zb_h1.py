"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) inside DeepSpeed's PipelineEngine: each
backward split into B (the input gradient) and W (the weight gradients), W deferred into 1F1B's idle slots.

The step's length is that of the order the engine runs (`dsx3d.pipeline.zb_greedy`, built for the relative F,
B and W durations `costs`; equal by default: each costs 2N FLOPs per token, the forward, the input gradient and
the weight gradients of the matrix products), in micro-batch times of F + B + W; stage s holds the order's
peak of micro-batches between their F and W, at most min(p, m): the most 1F1B's first stage holds. The
runtime is `dsx3d.pipeline.zb_schedule`; `parallel.zb_costs: auto` measures the costs (`zb_auto`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dsx3d.errors import Problem
from dsx3d.pipeline import zb_greedy
from dsx3d.pipeline.spec import Ratios, ScheduleSpec
from dsx3d.plan.layout import bubble_fraction

if TYPE_CHECKING:
    from dsx3d.boundary_types import HFConfig
    from dsx3d.recipe.schema import Recipe

NAME = "zb-h1"
KEY = "parallel.schedule"
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


def pipeline_units(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    if pp == 1:
        return micro_batches
    return _zb(pp, micro_batches, tuple(costs or EQUAL))[0]  # type: ignore[arg-type]


def held_micro_batches(stage: int, pp: int, micro_batches: int, costs: Ratios | None = None) -> int:
    if pp == 1:
        return min(pp - stage, micro_batches)
    return _zb(pp, micro_batches, tuple(costs or EQUAL))[1][stage]  # type: ignore[arg-type]


def idle(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    if pp == 1:
        return bubble_fraction(pp, micro_batches)
    return 1 - micro_batches / pipeline_units(pp, micro_batches, costs)


def problems(recipe: Recipe, hf_config: HFConfig | None) -> Iterator[Problem]:
    if recipe.parallel.pp == 1:
        yield Problem(
            KEY,
            NAME,
            "a schedule orders the work of pipeline stages; with parallel.pp = 1 there is no pipeline and "
            "zb-h1 changes nothing",
            "set parallel.pp > 1, or leave parallel.schedule at 1f1b",
            severity="warning",
        )
    if recipe.model.lora is not None:
        yield Problem(
            KEY,
            NAME,
            "with model.lora the base weights are frozen, so there are almost no weight gradients to defer "
            "(zero bubble has nothing to fill the idle time with), and the adapters' gradients are summed over "
            "TP by hooks that must run inside the backward pass",
            "set parallel.schedule: 1f1b for LoRA",
        )
    if hf_config is not None:
        from dsx3d.models.moe import experts_per_layer

        if experts_per_layer(hf_config) is not None:
            yield Problem(
                KEY,
                NAME,
                f"{hf_config.model_type} has mixture-of-experts layers: their experts compute weight gradients "
                "inside the backward pass and their token exchange is not ordered for deferred weight passes; "
                "zb-h1 is verified on dense models only",
                "set parallel.schedule: 1f1b for MoE models",
            )
    if recipe.train.activation_checkpointing:
        yield Problem(
            KEY,
            NAME,
            "with train.activation_checkpointing the gradients are right, but every micro-batch between its B and "
            "W pass keeps each deferred linear's recomputed input and output gradient (for a Llama layer over ten "
            "times its checkpoint), which undoes the memory the checkpointing saves and which the memory estimate "
            "does not count",
            "set train.activation_checkpointing: false, or parallel.schedule: 1f1b",
        )


SPEC = ScheduleSpec(
    name=NAME,
    summary="zero bubble: deferred weight-gradient passes fill 1F1B's idle slots (dense models, no LoRA)",
    pipeline_units=pipeline_units,
    held_micro_batches=held_micro_batches,
    problems=problems,
    idle=idle,
    measured_costs=True,
    with_activation_checkpointing=False,
    installer="dsx3d.pipeline.zb_schedule:install_for_recipe",
)
