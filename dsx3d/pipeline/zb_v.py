"""ZB-V, the V-shaped zero-bubble schedule (`parallel.schedule: zb-v`, with `parallel.virtual_stages: 2`): each
rank holds two chunks placed in a V (rank r: stages r and 2p - 1 - r), every backward is split into B and W, and
the order (`dsx3d.pipeline.zb_v_order`) fills the ranks' waits with W passes within 1F1B's peak memory.

Model: a step lasts the simulated length of the order the engine runs: built for the recipe's F, B and W costs,
or without them built for `zb_v_order.BUILD_DEFAULT` and timed with equal costs; in
micro-batch times of a whole stage (two chunks' F + B + W); rank r holds at its peak the order's most chunk
activations, each half a stage's, at most 2p: 1F1B's first stage's p micro-batches. Long accumulations are
extrapolated from two simulated lengths p apart, as zb-h1's are. The runtime is `dsx3d.pipeline.zb_v_schedule`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dsx3d.errors import Problem
from dsx3d.pipeline import interleaved, zb_h1
from dsx3d.pipeline.spec import Ratios, ScheduleSpec
from dsx3d.pipeline.zb_greedy import makespan, peak_in_flight
from dsx3d.pipeline.zb_v_order import BUILD_DEFAULT, VCosts, best_plan, run_plan

if TYPE_CHECKING:
    from dsx3d.boundary_types import HFConfig
    from dsx3d.recipe.schema import Recipe

NAME = "zb-v"
KEY = "parallel.virtual_stages"
CHUNKS = 2


@functools.lru_cache(maxsize=1024)
def _zbv(pp: int, micro_batches: int, costs: Ratios | None) -> tuple[float, tuple[int, ...]]:
    """(step length in micro-batch times of a whole stage, peak chunk activations per rank) of the order the engine
    runs for `costs`: built for them, or (None) built for `BUILD_DEFAULT` and timed with equal costs."""
    base = 4 * pp + (micro_batches - 4 * pp) % pp
    if micro_batches > base + pp:
        units_a, held = _zbv(pp, base, costs)
        units_b, _ = _zbv(pp, base + pp, costs)
        return units_b + (units_b - units_a) / pp * (micro_batches - base - pp), held
    plan = best_plan(pp, micro_batches, VCosts(*costs)) if costs else run_plan(pp, micro_batches, BUILD_DEFAULT, VCosts())
    total = sum(costs) if costs else 3.0
    return makespan(plan) / (CHUNKS * total), tuple(peak_in_flight(plan, r) for r in range(pp))


def pipeline_units(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    if pp == 1:
        return micro_batches
    return _zbv(pp, micro_batches, tuple(costs) if costs else None)[0]  # type: ignore[arg-type]


def held_micro_batches(stage: int, pp: int, micro_batches: int, costs: Ratios | None = None) -> int:
    """Whole-stage micro-batches' worth of activations (two chunk activations each), rounded up."""
    if pp == 1:
        return min(1, micro_batches)
    return math.ceil(_zbv(pp, micro_batches, tuple(costs) if costs else None)[1][stage] / CHUNKS)  # type: ignore[arg-type]


def idle(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    return 1 - micro_batches / pipeline_units(pp, micro_batches, costs)


def problems(recipe: Recipe, hf_config: HFConfig | None) -> Iterator[Problem]:
    """What the checker refuses with ZB-V: what zb-h1 refuses (LoRA, MoE, activation checkpointing) and what the
    chunked runtime does not run (`interleaved._unsupported`), a chunk count other than two, pp = 1, fewer than
    2 pp decoder layers, and DPO (its reference pass reads the loss on the last rank of the pipe)."""
    p = recipe.parallel
    fix = "set parallel.schedule: 1f1b and parallel.virtual_stages: 1"
    if p.virtual_stages != CHUNKS:
        yield Problem(KEY, p.virtual_stages, f"{NAME} places two chunks per rank in a V", f"set {KEY}: {CHUNKS}")
    if p.pp < 2:
        yield Problem("parallel.pp", p.pp, f"{NAME} orders the chunks of a pipeline; pp = 1 has none", f"set parallel.pp >= 2, or {fix}")
    for key, value, bad, reason, change in interleaved._unsupported(recipe):
        if bad and key not in ("train.activation_checkpointing", "model.lora"):  # zb-h1's rules say why
            yield Problem(key, value, f"{NAME}: {reason}", f"{change}, or {fix}")
    if recipe.train.objective == "dpo" or (recipe.train.objective is None and recipe.data.format == "preference"):
        yield Problem("train.objective", "dpo", f"{NAME}: the DPO objective is not verified with the loss on rank 0 of the pipe", fix)
    for problem in zb_h1.problems(recipe, hf_config):
        if problem.severity != "warning":
            yield Problem(problem.key, problem.value if problem.key != "parallel.schedule" else NAME, problem.reason.replace(zb_h1.NAME, NAME), problem.fix)
    if hf_config is not None:
        layers = getattr(hf_config.get_text_config(), "num_hidden_layers", None)
        if isinstance(layers, int) and p.pp * CHUNKS > layers:
            ways = f"parallel.pp <= {layers // CHUNKS}, or " if layers // CHUNKS >= 2 else ""
            yield Problem(
                "parallel.pp",
                p.pp,
                f"{NAME} cuts the model into 2 pp = {p.pp * CHUNKS} stages, each with at least one decoder layer, "
                f"and the model has {layers}",
                f"set {ways}{fix.removeprefix('set ')}",
            )


SPEC = ScheduleSpec(
    name=NAME,
    summary="ZB-V: two chunks per rank in a V, B and W split, W filling the waits (parallel.virtual_stages: 2)",
    pipeline_units=pipeline_units,
    held_micro_batches=held_micro_batches,
    problems=problems,
    idle=idle,
    measured_costs=True,
    with_activation_checkpointing=False,
    virtual_stages=CHUNKS,
    placement="v",
    installer="dsx3d.pipeline.zb_v_schedule:install_for_recipe",
)
