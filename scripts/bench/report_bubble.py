"""The report section of scripts/bench/bubble.py's result (kept out of report.py, which is large)."""

from __future__ import annotations

from typing import Any


def _cells(values: list[Any], fmt: str) -> str:
    return ", ".join("-" if x is None else format(x, fmt) for x in values)


def _span(x: dict[str, float] | None) -> str:
    return "-" if not x else f"{x['median']:.3f} [{x['min']:.2f}-{x['max']:.2f}]"


def bubble(r: dict[str, Any], header: list[str]) -> list[str]:
    """1F1B, zb-h1 and zb-h1 with measured costs at p = 2 and 4 (scripts/bench/bubble.py, one run)."""
    split = f", stage_layers {r['stage_layers']}" if r.get("stage_layers") else ""
    names = sorted({row["schedule"] for run in r["runs"].values() for row in run["rows"]})
    title = "1F1B, zb-h1 and zb-h1 with measured costs" if not any("interleaved" in n for n in names) else ", ".join(names)
    out = [f"## Pipeline bubble: {title}{split}", ""] + header
    w = r["workload"]
    bounds = "; ".join(f"p = {p}: {run['stage_bounds']}" for p, run in r["runs"].items())
    out += [
        f"Tiny Llama ({w['layers']} layers, width {w['hidden']}, vocabulary {w['vocab']}), micro-batch {w['micro_batch']} x "
        f"{w['seq_len']} tokens, fp32, one thread per rank on {r.get('cores', 2)} cores (p = 4 runs 4 processes on them); "
        f"stage bounds over [embedding, layers, norm, head] {bounds}; {r['rounds']} timed rounds, the schedules stepped "
        "alternately in each. `zb-h1 auto`: `parallel.zb_costs: auto` (order built from the F, B, W measured in the "
        "second and third steps). Idle: mean over stages; wall, and replayed with each instruction's CPU time as its duration "
        "(`scripts/bench/replay.py`; wall time on this shared machine mostly measures the wait for a core). `bound`: the "
        "schedule's own (1F1B (p-1)/(m+p-1); ZB-H1 for F = B = W; the auto order simulated with its measured costs; "
        "interleaved (p-1)/(v m+p-1); ZB-V: its order with the costs it was built for, B = 1.25 F, W = 0.6 F by "
        "default, the measured ones with `auto`); v: chunks per rank; "
        "`simulated`: the row's order with this run's per-stage CPU costs and free transfers. Ratios: new / 1F1B per "
        "round, median [min-max].",
        "",
        "| schedule | p | m | v | bound | simulated | idle wall | idle replayed | replayed idle per stage | step ratio wall | step ratio replayed | peak memory ratio per stage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in r["runs"].values():
        for row in run["rows"]:
            out.append(
                f"| {row['schedule'].replace('-auto', ' auto')} | {row['p']} | {row['m']} | {row.get('v', 1)} | {row['analytic']:.3f} | "
                f"{row.get('simulated', float('nan')):.3f} | {row['idle_mean']:.3f} | {row['replayed_idle_mean']:.3f} | "
                f"{_cells(row['replayed_idle_per_stage'], '.3f')} | {_span(row.get('step_ratio_vs_1f1b'))} | "
                f"{_span(row.get('replayed_ratio_vs_1f1b'))} | {_cells(row.get('peak_ratio_vs_1f1b', []), '.2f') or '-'} |"
            )
    out += [
        "",
        "Where each stage's step went, ms per micro-batch (wall; CPU ms per pass in the last column): F, B, W, waiting "
        "in receives and sends, dispatch between instructions, and `other` (gradient reduce and optimizer step, after "
        "the pipeline window).",
        "",
        "| schedule | p | m | F | B | W | recv | send | dispatch | other | CPU F / B / W per stage |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in r["runs"].values():
        for row in run["rows"]:
            t, c = row["wall_ms_per_micro_batch"], row["cpu_ms_per_pass"]
            cpu = "; ".join(
                " / ".join("-" if c[k][i] is None else f"{c[k][i]:.1f}" for k in ("F", "B", "W")) for i in range(row["p"])
            )
            cols = " | ".join(_cells(t[k], ".1f") for k in ("F", "B", "W", "recv", "send", "dispatch", "other"))
            out.append(f"| {row['schedule'].replace('-auto', ' auto')} | {row['p']} | {row['m']} | {cols} | {cpu} |")
    out.append("")
    return out
