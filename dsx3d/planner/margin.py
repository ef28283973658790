"""By how much the planner's choice beats the runner-up, and which time term decides it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsx3d.estimate import Estimate, Hardware, ModelShape, Setup, estimate, schedules
from dsx3d.estimate.interleaved import NAME as INTERLEAVED
from dsx3d.pipeline.registry import SCHEDULE_NAMES
from dsx3d.planner.search import Candidate, PlanResult


@dataclass(frozen=True)
class Margin:
    runner_up: Candidate
    speedup: float
    """Runner-up's step time over the choice's (same tokens per step): 1.10 = the choice is 10% faster."""
    deciding_term: str
    """The term whose seconds differ most in the choice's favour."""
    deciding_seconds: float
    differences: dict[str, float]
    """Runner-up minus choice, seconds per step by term (positive: the choice spends less)."""


def step_terms(est: Estimate) -> dict[str, float]:
    """Seconds per step by term: the physical model's terms, or the single-efficiency model's parts (its
    bubble being the pipeline time beyond the slowest stage's m micro-batches)."""
    if est.terms:
        return {k: v for k, v in est.terms.items() if k != "dp_overlapped"}
    t = est.time_s
    busy = sum(t.get(k, 0.0) for k in ("compute", "tp", "ep", "cp", "pp"))
    parts = {k: t.get(k, 0.0) for k in ("compute", "tp", "ep", "cp", "pp", "dp", "tied")}
    parts["bubble"] = max(0.0, t.get("pipeline", 0.0) - busy)
    return parts


def margin(result: PlanResult) -> Margin | None:
    """The choice against the best candidate of another layout group (dp, cp, tp, pp, ZeRO, ep), else against
    the next candidate; None with fewer than two candidates."""
    if len(result.ranked) < 2:
        return None
    best = result.ranked[0]
    others = [c for c in result.ranked[1:] if c.group_key != best.group_key]
    runner = others[0] if others else result.ranked[1]
    mine, theirs = step_terms(best.estimate), step_terms(runner.estimate)
    diffs = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in dict.fromkeys([*mine, *theirs])}
    term = max(diffs, key=lambda k: diffs[k])
    return Margin(runner, runner.estimate.step_time_s / best.estimate.step_time_s, term, diffs[term], diffs)


def describe(m: Margin) -> str:
    return (
        f"beats the runner-up ({m.runner_up.label()}, {m.runner_up.setup.schedule}, {m.runner_up.estimate.step_time_s:.3f} s) by "
        f"{m.speedup - 1:.1%}; decided by {m.deciding_term} ({m.deciding_seconds:+.3f} s per step in its favour)"
    )


@dataclass(frozen=True)
class Alternative:
    """What a schedule the engine does not run (`schedules.ESTIMATOR_ONLY`) would give the chosen layout: reported,
    never picked."""

    schedule: str
    virtual_stages: int
    speedup: float
    """The choice's step time over this one's: 1.05 = 5% faster than the choice."""
    fits: bool
    """Whether its peak memory stays within the usable memory."""
    estimate: Estimate


def _virtual_stage_options(shape: ModelShape, setup: Setup, limit: int = 4) -> list[int]:
    """Chunks per rank interleaved 1F1B could use: equal chunks of whole layers, m a multiple of pp (Megatron's rule)."""
    if setup.grad_accum % setup.pp:
        return []
    return [v for v in range(2, limit + 1) if shape.num_layers % (setup.pp * v) == 0]


def estimator_only_alternatives(
    shape: ModelShape, chosen: Candidate, hardware: Hardware, memory_gb: float, searched: tuple[str, ...] = SCHEDULE_NAMES
) -> list[Alternative]:
    """The chosen layout under every schedule the search did not try (`searched`: those it did): the
    estimator-only ones and, where `--schedule` left it out, interleaved 1F1B at every virtual-stage count it
    allows; on devices of `memory_gb`, fastest first; empty without a pipeline."""
    setup = chosen.setup
    hardware = replace(hardware, gpu_memory_gb=memory_gb)
    if setup.pp == 1:
        return []
    tries: list[tuple[str, int]] = []
    unsearched = [n for n in (*schedules.ESTIMATOR_ONLY, INTERLEAVED) if n not in searched]
    for name in unsearched:
        if name == INTERLEAVED:
            tries += [(name, v) for v in _virtual_stage_options(shape, setup)]
        else:
            tries.append((name, 1))
    out = []
    for name, v in tries:
        est = estimate(shape, replace(setup, schedule=name, virtual_stages=v, stage_layers=None), hardware)
        out.append(Alternative(name, v, chosen.estimate.step_time_s / est.step_time_s, est.fits is not False, est))
    return sorted(out, key=lambda a: -a.speedup)


def describe_alternative(a: Alternative) -> str:
    v = f" v={a.virtual_stages}" if a.virtual_stages > 1 else ""
    fit = "" if a.fits else f", but {a.estimate.total_gb:.1f} GB does not fit"
    why = (
        "not searched: set parallel.schedule and parallel.virtual_stages"
        if schedules.runnable(a.schedule)
        else "estimator only: dsx3d's engine does not run it"
    )
    return (
        f"{a.schedule}{v} ({why}) would take "
        f"{a.estimate.step_time_s:.3f} s, {a.speedup - 1:+.1%} against the choice{fit}"
    )
