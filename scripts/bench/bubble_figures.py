"""The bubble benchmark's figures from the events of its ranks (`scripts/bench/bubble.py` says how they are
measured): per row, idle per stage (wall and replayed), where each stage's step went (passes, receive and send
waits, loading, other instructions, dispatch), per-pass CPU costs, peak memory; across rows, each order's
bounds and the per-round ratios against 1F1B."""

from __future__ import annotations

import statistics
from typing import Any

from dsx3d.pipeline import interleaved, zb_greedy, zb_plan, zb_v, zb_v_order
from dsx3d.pipeline.stage_clock import PARTS, breakdown, category, part_costs
from scripts.bench.replay import replay
from scripts.bench.results import rounded

PASSES = frozenset(n for names in PARTS.values() for n in names)


def _ms(values: list[float]) -> float:
    return rounded(1e3 * statistics.median(values), 3)


def stage_figures(per_rank: list[dict[str, Any]], name: str, m: int, shape: str = "looped") -> dict[str, Any]:
    n_steps = len(per_rank[0]["steps"][name])
    stages = [r["stage"] for r in per_rank]
    idle: dict[int, list[float]] = {s: [] for s in stages}
    spent: dict[int, list[dict[str, float]]] = {s: [] for s in stages}
    costs: dict[int, list[dict[str, float | None]]] = {s: [] for s in stages}
    peaks: dict[int, list[int]] = {s: [] for s in stages}
    windows, replayed = [], []
    for i in range(n_steps):
        steps = {r["stage"]: r["steps"][name][i] for r in per_rank}
        replayed.append(replay({s: [(e.name, e.busy, e.chunk) for e in st["events"]] for s, st in steps.items()}, shape))
        start = max(st["start"] for st in steps.values())
        end = max(e.end for st in steps.values() for e in st["events"] if e.name in PASSES)
        windows.append(end - start)
        for s, st in steps.items():
            busy = sum(e.wall for e in st["events"] if e.name in PASSES)
            idle[s].append(1 - busy / (end - start))
            spent[s].append(breakdown(st["events"]))
            costs[s].append(part_costs(st["events"]))
            if st["peak_kb"] is not None:
                peaks[s].append(st["peak_kb"])

    def per_mb(s: int, key: str) -> float:
        return _ms([x[key] / m for x in spent[s]])

    def cost(s: int, part: str) -> float | None:
        values = [c[part] for c in costs[s] if c[part] is not None]
        return _ms(values) if values else None  # type: ignore[arg-type]

    return {
        "idle_per_stage": [rounded(statistics.fmean(idle[s]), 3) for s in stages],
        "idle_mean": rounded(statistics.fmean(statistics.fmean(idle[s]) for s in stages), 3),
        "replayed_idle_per_stage": [
            rounded(statistics.fmean(1 - x["busy"][s] / x["window"] for x in replayed), 3) for s in stages
        ],
        "replayed_idle_mean": rounded(
            statistics.fmean(statistics.fmean(1 - x["busy"][s] / x["window"] for x in replayed) for s in stages), 3
        ),
        "cpu_ms_per_pass": {part: [cost(s, part) for s in stages] for part in PARTS},
        "wall_ms_per_micro_batch": {
            key: [per_mb(s, key) for s in stages] for key in ("F", "B", "W", "recv", "send", "load", "other", "dispatch")
        },
        "cpu_ms_per_micro_batch": {
            key: [_ms([_cpu(st["events"], key) / m for st in r["steps"][name]]) for r in per_rank]
            for key in ("recv", "send", "load", "other")
        },
        "window_ms": _ms(windows),
        "replayed_window_ms": _ms([x["window"] for x in replayed]),
        "window_s_per_step": [rounded(w, 4) for w in windows],
        "replayed_s_per_step": [rounded(x["window"], 4) for x in replayed],
        "peak_mib_per_stage": [rounded(max(peaks[s]) / 1024, 3) if peaks[s] else None for s in stages],
    }


def _cpu(events: list[Any], key: str) -> float:
    """CPU seconds of one step's instructions of a kind (`stage_clock.category`: `recv`, `send`, `load`, `other`)."""
    return sum(e.busy for e in events if category(e.name) == key)


def _idle(plan: zb_greedy.Plan | tuple[tuple[zb_greedy.Timed, ...], ...]) -> float:
    rows = [list(row) for row in plan]
    return rounded(statistics.fmean(zb_greedy.idle_fraction(rows)), 3)


def _orders(kind: str, p: int, m: int, agreed: zb_greedy.Costs | None) -> list[list[zb_greedy.Op]]:
    if kind == "1f1b":
        return zb_greedy.one_f_one_b(p, m)
    plan = zb_greedy.best_plan(p, m, agreed or zb_greedy.Costs.uniform(p))
    return [[x.op for x in row] for row in plan]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": rounded(statistics.median(values), 3), "min": rounded(min(values), 3), "max": rounded(max(values), 3)}


def _interleaved_bounds(row: dict[str, Any], p: int, m: int, v: int) -> None:
    """The paper's idle, and the order simulated with this row's CPU costs per chunk pass (mean over ranks)."""
    row["analytic"] = rounded(interleaved.idle(p, m, v=v), 3)
    c = row["cpu_ms_per_pass"]
    f, b = (statistics.fmean(x for x in c[k] if x is not None) for k in ("F", "B"))
    finish = interleaved.simulate(p, m, v, f, b).finish
    row["simulated"] = rounded(1 - m * v * (f + b) / finish, 3)


def _zb_v_bounds(row: dict[str, Any], p: int, m: int, agreed: zb_greedy.Costs | None) -> None:
    """The row's ZB-V order (built for the costs the run measured, else `BUILD_DEFAULT`) with the costs it was
    built for, and with this row's CPU costs per chunk pass (mean over ranks)."""
    build = zb_v_order.BUILD_DEFAULT
    if agreed is not None:
        build = zb_v_order.VCosts(*(statistics.fmean(getattr(agreed, k)) for k in ("f", "b", "w")))
    c = row["cpu_ms_per_pass"]
    real = zb_v_order.VCosts(*(statistics.fmean(x for x in c[k] if x is not None) for k in ("F", "B", "W")))
    for key, costs in (("analytic", build), ("simulated", real)):
        plan = zb_v_order.run_plan(p, m, build, costs)
        row[key] = rounded(1 - 2 * m * (costs.f + costs.b + costs.w) / zb_greedy.makespan(plan), 3)


def compare(
    rows: list[dict[str, Any]], per_rank: list[dict[str, Any]], schedules: dict[str, tuple[str, str | None, int]]
) -> None:
    """Adds to each row its bounds and, for the rows other than 1F1B, the per-round ratios against 1F1B."""
    by = {(r["schedule"], r["m"]): r for r in rows}
    for row in rows:
        p, m, name = row["p"], row["m"], row["schedule"]
        kind, costs, v = schedules[name]
        row["v"] = v
        agreed = per_rank[0]["costs"].get(f"{name}:m{m}") if costs == "auto" else None
        if agreed is not None:
            row["measured_costs_ms"] = {k: [rounded(1e3 * x, 3) for x in getattr(agreed, k)] for k in ("f", "b", "w")}
        if kind == interleaved.NAME:
            _interleaved_bounds(row, p, m, v)
        elif kind == zb_v.NAME:
            _zb_v_bounds(row, p, m, agreed)
        elif kind == "1f1b":
            row["analytic"] = rounded((p - 1) / (m + p - 1), 3)
        else:
            row["analytic"] = _idle(zb_greedy.simulate(_orders(kind, p, m, agreed), agreed)) if agreed else rounded(
                zb_plan.analytic_idle(p, m), 3
            )
        source = by.get(("zb-h1", m)) or by.get(("zb-h1-auto", m))
        if source is not None and kind not in (interleaved.NAME, zb_v.NAME):  # this run's per-stage CPU costs of F, B and W
            c = source["cpu_ms_per_pass"]
            measured = zb_greedy.Costs(*(tuple(x or 1e-3 for x in c[k]) for k in ("F", "B", "W")))
            row["simulated"] = _idle(zb_greedy.simulate(_orders(kind, p, m, agreed), measured))
        base = by.get(("1f1b", m))
        if base is None or name == "1f1b":
            continue
        row["step_ratio_vs_1f1b"] = _spread([a / b for a, b in zip(row["window_s_per_step"], base["window_s_per_step"], strict=True)])
        row["replayed_ratio_vs_1f1b"] = _spread(
            [a / b for a, b in zip(row["replayed_s_per_step"], base["replayed_s_per_step"], strict=True)]
        )
        row["peak_ratio_vs_1f1b"] = [
            rounded(z / o, 3) if z and o else None for z, o in zip(row["peak_mib_per_stage"], base["peak_mib_per_stage"], strict=True)
        ]
