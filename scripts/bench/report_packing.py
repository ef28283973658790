"""The report section of scripts/bench/packing.py's result (kept out of report.py, which is large)."""

from __future__ import annotations

from typing import Any


def packing(r: dict[str, Any]) -> list[str]:
    lay, w, q = r["layout"], r["workload"], r["packed_over_padded"]
    load = f"load average {r['loadavg_start']} -> {r['loadavg_end']}"
    out = [f"## Packed SFT rows against padded examples (dp{lay['dp']} tp{lay['tp']} pp{lay['pp']})", ""]
    out += [
        f"`{r['command']}`; {load}. Synthetic chat examples of {w['lengths']} tokens, seq_len {w['seq_len']}, "
        f"micro-batch {w['micro_batch']}, global batch {w['global_batch']} rows, {r['rounds']} alternated steps each:",
        "",
        "| rows | padding fraction | non-padding tokens/s |",
        "|---|---|---|",
        f"| one padded example per row | {r['padding_fraction']['padded']:.3f} | {r['real_tokens_per_s']['padded']:,.0f} |",
        f"| packed (data.packing) | {r['padding_fraction']['packed']:.3f} | {r['real_tokens_per_s']['packed']:,.0f} |",
        "",
        f"Packed / padded, non-padding tokens per second: **{q['median']:.2f}x** (median of per-round ratios, "
        f"95% CI {q['ci95_low']:.2f}-{q['ci95_high']:.2f}, {q['pairs']} pairs).",
        "",
    ]
    return out
