"""The report section of scripts/bench/context_parallel.py's result (kept out of report.py, which is large)."""

from __future__ import annotations

from typing import Any


def _spread(q: dict[str, Any]) -> str:
    return f"{q['median']:.3g} (quartiles {q['q1']:.3g}-{q['q3']:.3g})"


def _pct(q: dict[str, Any]) -> str:
    return f"{100 * q['median']:.1f}% (quartiles {100 * q['q1']:.1f}-{100 * q['q3']:.1f}%)"


def _budget(r: dict[str, Any]) -> list[str]:
    b, m = r["budget"], r["budget_model"]
    out = [
        f"**Longest seq_len within {b['budget_mib']:.0f} MiB per rank** (the rank's resident set above its resident set at "
        f"the fork: runtime, states and activations of the first training step; a {m['layers']}-layer Llama of width "
        f"{m['hidden']}, {m['heads']} heads, vocabulary {m['vocab']}; seq_len doubled from {b['start']:,}, each try in a "
        "fresh process group, a try stopped as soon as a rank passes the budget):",
        "",
        "| cp | longest seq_len | / cp 1 | tries (seq_len: MiB over the fork, or over budget) |",
        "|---|---|---|---|",
    ]
    for cp, v in b["by_cp"].items():
        tries = ", ".join(
            f"{t['seq_len']:,}: {t['peak_over_fork_mib']:.0f}" if t["fits"] else
            f"{t['seq_len']:,}: over" for t in v["tries"]
        )
        longest = f"{v['longest_seq_len']:,}" if v["longest_seq_len"] else "none"
        capped = f" (the cap, {b['cap']:,}, reached)" if v["capped"] else ""
        over = f"{v['over_cp1']:.0f}x" if v["over_cp1"] else "-"
        out.append(f"| {cp} | {longest}{capped} | {over} | {tries} |")
    return out + [""]


def _estimator(r: dict[str, Any]) -> list[str]:
    e = r["estimator"]
    out = [
        "**The estimator** (`dsx3d.estimate`, same shapes, fp32, ZeRO-0) against the measured step peak above:",
        "",
        "| cp | attention counted as | estimated activations, MiB | + gradients + transients (what the step adds) | "
        "measured, MiB | measured / activations | measured / what the step adds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in e["rows"]:
        out.append(
            f"| {row['cp']} | {row['attention']} | {row['activations_mib']:,.1f} | {row['step_added_mib']:,.1f} | "
            f"{row['measured_step_peak_mib']:,.1f} | {row['measured_over_activations']:.3f} | "
            f"{row['measured_over_step_added']:.3f} |"
        )
    ratios = e["estimated_ratio_cp2_over_cp1"]
    out += [
        "",
        f"Estimated cp 2 / cp 1: {ratios['unfused']:.3f} (unfused), {ratios['flash']:.3f} (flash). On CPU, torch's "
        "sdpa runs in its flash-attention kernel (`torch._fused_sdp_choice` picks it for these shapes), which keeps "
        "no s x s scores, so "
        "the flash rows are the comparable ones (`dsx3d estimate --flash-attention`); the unfused rows count the "
        "scores and probabilities of every head. The step's measured peak falls short of activations + gradients "
        "because the estimator holds the whole of both at once, while the backward frees activations as "
        "gradients appear.",
        "",
    ]
    return out


def _sent_analytic(r: dict[str, Any]) -> float:
    """The estimator's all-to-all bytes one rank sends per step at cp 2 (one micro-batch of 2 sequences)."""
    from dsx3d.estimate.context_parallel import alltoall_bytes_per_micro_batch

    m, t = r["model"], r["time"]
    return alltoall_bytes_per_micro_batch(
        layers=m["layers"], cp=2, tp=1, seq_len=t["seq_len"], micro_batch=2, num_heads=m["heads"],
        num_kv_heads=m["kv_heads"], head_dim=m["hidden"] // m["heads"], width=4, checkpointing=False,
    )


def context_parallel(r: dict[str, Any]) -> list[str]:
    m, mem, t = r["model"], r["memory"], r["time"]
    sent, analytic = t["a2a_bytes_sent_per_step"] / 2, _sent_analytic(r)
    grads = r["estimator"]["rows"][0]["grads_mib"]
    med = mem["median_step_peak_mib"]
    covered = (med["2"] - grads) / (med["1"] - grads)
    load = f"load average {r['loadavg_start'][0]:.1f} at the start, {r['loadavg_end'][0]:.1f} at the end"
    quick = " (quick smoke run: not a measurement)" if r.get("quick") else ""
    peaks = mem["step_peak_mib"]
    runs = "; ".join(
        f"cp {cp}: " + ", ".join("/".join(f"{x:.0f}" for x in ranks) for ranks in v) for cp, v in peaks.items()
    )
    ratio, cpu = t["ratio_cp2_over_dp2"], t["cpu_ratio_cp2_over_dp2"]
    noise = (
        "the 95% interval of the median contains 1: the difference is inside the noise"
        if t["difference_inside_noise"] else "the 95% interval of the median excludes 1"
    )
    out = [
        "## Context parallelism: activation memory, sequence length within a budget, step time",
        "",
        f"Command: `{r['command']}`{quick}; {r['when']}, {load}, {r['wall_s']} s.",
        "",
        f"A {m['layers']}-layer Llama of width {m['hidden']} ({m['heads']} heads, {m['kv_heads']} KV heads, MLP "
        f"{m['intermediate']}, vocabulary {m['vocab']}, untied), fp32, ZeRO-0, pp 1, tp 1, sdpa attention, one thread "
        "per rank; Ulysses context parallelism (`parallel.cp`).",
        "",
        f"**Activation memory at {mem['seq_len']:,} tokens**: each rank's peak resident set over one training step above "
        "its resident set before it (after a warm-up step; VmHWM reset through /proc/self/clear_refs), fresh ranks "
        f"per run, runs alternated; MiB per run and rank: {runs}. Medians of the fullest rank: cp 1 "
        f"{mem['median_step_peak_mib']['1']:,.0f}, cp 2 {mem['median_step_peak_mib']['2']:,.0f}; "
        f"cp 2 / cp 1: **{mem['ratio_cp2_over_cp1']:.3f}**; less the weight gradients, which every CP rank holds "
        f"whole ({grads:.1f} MiB, freed after each step), {covered:.3f}.",
        "",
    ]
    out += _budget(r)
    out += [
        f"**Step time**, the same {t['tokens_per_step']:,} tokens per step (2 sequences of {t['seq_len']:,}) on the same "
        "2 ranks: dp 2 x cp 1 against dp 1 x cp 2, both engines in the same ranks, stepped alternately, "
        f"{t['pairs']} timed rounds. Step seconds (slowest rank): dp 2 {_spread(t['step_s']['dp2'])}, cp 2 "
        f"{_spread(t['step_s']['cp2'])}. cp 2 / dp 2: **{ratio['median']:.3f}** (quartiles {ratio['q1']:.3f}-"
        f"{ratio['q3']:.3f}, 95% interval of the median {ratio['ci95_low']:.3f}-{ratio['ci95_high']:.3f}: {noise}); "
        f"CPU seconds summed over ranks {cpu['median']:.3f} ({cpu['ci95_low']:.3f}-{cpu['ci95_high']:.3f}). "
        f"All-to-all: {t['a2a_calls_per_step']} calls per step and rank, {t['a2a_bytes_sent_per_step'] / 2**20:.1f} MiB "
        f"passed per rank, of which half leaves the rank: {sent / 2**20:.1f} MiB "
        f"({'equal to' if sent == analytic else 'against'} the estimator's {analytic / 2**20:.1f} MiB); {_spread(t['a2a_s_per_step'])} s per step, a share of **{_pct(t['a2a_share_of_step'])}** "
        "of the cp 2 step (wall time inside `all_to_all_single`, waiting for the peer included). Largest loss "
        f"difference between the two layouts: {t['max_abs_loss_diff']:.2g}.",
        "",
    ]
    return out + _estimator(r)
