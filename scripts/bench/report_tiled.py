"""The report section of scripts/bench/tiled_loss.py's result (kept out of report.py, which is large)."""

from __future__ import annotations

from typing import Any


def tiled_loss(r: dict[str, Any]) -> list[str]:
    m, peaks, med = r["model"], r["peak_over_start_mib"], r["median_peak_over_start_mib"]
    load = f"load average {r['loadavg_start'][0]:.1f} at the start, {r['loadavg_end'][0]:.1f} at the end"
    quick = " (quick smoke run: not a measurement)" if r.get("quick") else ""
    medians = r.get("median_peak_allocated_mib", {})

    def alloc(name: str) -> str:
        return f"{medians[name]:,.0f}" if name in medians else "not measured"

    ratio = r.get("ratio_tiled_over_full_allocated")
    allocated_ratio = f"**{ratio:.3f}**" if ratio is not None else "not measured"
    return [
        "## Last-stage peak memory: tiled logits and loss against full logits",
        "",
        f"Command: `{r['command']}`{quick}; {r['when']}, {load}, {r['wall_s']} s.",
        "",
        f"A one-layer Llama of width {m['hidden']} with a {m['vocab']:,}-token vocabulary (untied head), one micro-batch "
        f"of {r['seq_len']:,} tokens, fp32, ZeRO-0, pp 1 and tp 1 (the head and its loss are nearly all of the stage's "
        "activation memory). Each run is a forked process: a warm-up step, then the peak resident set over one more "
        "optimizer step above the resident set before it (VmHWM reset through /proc/self/clear_refs; large "
        f"allocations mapped on their own). The full logits are {r['full_logits_fp32_mib']:,.0f} MiB in fp32, one tile "
        f"of {r['loss_tile_tokens']} tokens {r['tile_logits_fp32_mib']:,.0f} MiB. {r['rounds']} runs of each, alternated:",
        "",
        "| `train.loss_tile_tokens` | peak over the step's start, MiB (each run) | median | peak of live tensors, MiB | loss |",
        "|---|---|---|---|---|",
        f"| 0 (full logits) | {', '.join(f'{x:,.0f}' for x in peaks['full'])} | {med['full']:,.0f} | {alloc('full')} "
        f"| {r['losses']['full'][0]} |",
        f"| {r['loss_tile_tokens']} | {', '.join(f'{x:,.0f}' for x in peaks['tiled'])} | {med['tiled']:,.0f} | "
        f"{alloc('tiled')} | {r['losses']['tiled'][0]} |",
        "",
        f"Tiled / full peak: **{r['ratio_tiled_over_full']:.3f}** (resident set), {allocated_ratio} (live tensors: torch's "
        "allocator events over a third, profiled step, the figure the smoke test holds to). What remains with tiles is "
        "the rest of the step: the head's weight and its gradient, Adam's update, the decoder layer's activations.",
        "",
    ]
