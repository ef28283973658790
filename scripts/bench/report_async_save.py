"""The report section of scripts/bench/async_save.py's result (kept out of report.py, which is large)."""

from __future__ import annotations

from typing import Any


def _q(q: dict[str, Any]) -> str:
    return f"**{q['median']:.3f}** (95% interval {q['ci95_low']:.3f}-{q['ci95_high']:.3f}, quartiles {q['q1']:.3f}-{q['q3']:.3f})"


def async_save(r: dict[str, Any]) -> list[str]:
    lay, w, med = r["layout"], r["workload"], r["median_s"]
    over_plain, cost = r["saving_step_over_plain_step"], r["window_cost_in_plain_steps"]
    quick = " (quick smoke run: not a measurement)" if r.get("quick") else ""
    out = [
        f"## Checkpoint saves: the manifest's cost, and synchronous against train.async_save (dp{lay['dp']} tp{lay['tp']} pp{lay['pp']})",
        "",
    ]
    out += [
        f"Command: `{r['command']}`{quick}; {r['when']}, load average {r['loadavg_start'][0]:.1f} at the start, "
        f"{r['loadavg_end'][0]:.1f} at the end, {r['wall_s']} s.",
        "",
        f"Tiny Llama, {r['tag_bytes'] / 1e6:.0f} MB per tag; micro-batch {w['micro_batch']} x {w['seq_len']} tokens, "
        f"global batch {w['global_batch']}, {w['dtype']}, ZeRO-1. {r['pairs']} rounds of windows (a step with or without "
        f"a save, {r['after']} plain steps, the wait for the save), alternated in the same 2 ranks. `bare` is the "
        "synchronous save without checksums or manifest (as before manifests), `sync` the default save, `async` "
        "`train.async_save`:",
        "",
        "| window | saving step (s) | saving step / plain step | window (s) | window cost, in plain steps |",
        "|---|---|---|---|---|",
        f"| plain | {med['plain']['saving_step']} | 1 | {med['plain']['window']} | 0 |",
        *(
            [f"| bare | {med['bare']['saving_step']} | {over_plain['bare']['median']:.3f} | {med['bare']['window']} | {cost['bare']:.3f} |"]
            if "bare" in med  # results from before the bare window was measured
            else []
        ),
        f"| sync | {med['sync']['saving_step']} | {over_plain['sync']['median']:.3f} | {med['sync']['window']} | {cost['sync']:.3f} |",
        f"| async | {med['async']['saving_step']} | {over_plain['async']['median']:.3f} | {med['async']['window']} | {cost['async']:.3f} |",
        "",
        (
            f"Saving step, with the manifest / without (sync / bare): {_q(r['saving_step_manifest_over_bare'])}. "
            if "saving_step_manifest_over_bare" in r
            else ""
        )
        + f"Saving step, async / sync: {_q(r['saving_step_async_over_sync'])}. CPU seconds of the window (all threads, "
        f"summed over ranks), async / sync: {_q(r['window_cpu_async_over_sync'])}. The tags went to the page cache of "
        "a local disk (neither save fsyncs its data files), where a synchronous save is short; on slower storage "
        "a synchronous save holds the step for longer, and that wait is what the background thread takes off the "
        "step (not measured here: `--dir` measures your storage).",
        "",
    ]
    return out
