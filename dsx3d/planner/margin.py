"""By how much the planner's choice beats the runner-up, and which time term decides it."""

from __future__ import annotations

from dataclasses import dataclass

from dsx3d.estimate import Estimate
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
