"""Render scripts/bench/results.json as the docs' benchmarks page (docs/benchmarks.md): every figure with its command,
the machine, the versions and the load average it was measured under.

    python -m scripts.bench.report [--results scripts/bench/results.json] [--out FILE | --out -]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from scripts.bench.report_async_save import async_save
from scripts.bench.report_bubble import bubble
from scripts.bench.report_cp import context_parallel
from scripts.bench.report_packing import packing
from scripts.bench.report_peer import pipeline_peer
from scripts.bench.report_tiled import tiled_loss
from scripts.bench.report_verify import verify_sweep

RESULTS = Path(__file__).resolve().parent / "results.json"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def _load(r: dict[str, Any]) -> str:
    return f"load average {r['loadavg_start'][0]:.1f} at the start, {r['loadavg_end'][0]:.1f} at the end"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _ci(q: dict[str, Any]) -> str:
    return f", 95% interval of the median {q['ci95_low']:.3f}-{q['ci95_high']:.3f}" if "ci95_low" in q else ""


def _goal(r: dict[str, Any]) -> str:
    """Met by the median, and confirmed where the median's 95% interval lies under the goal."""
    goal, wall, cpu = r["goal"], r["ratio"], r["cpu_ratio"]
    verdict = "met by the median" if r["meets_goal"] else "not met by the median"
    confirmed = [
        name for name, q in (("wall time", wall), ("CPU time", cpu)) if q.get("ci95_high", 9) <= goal
    ]
    unsure = [name for name, q in (("wall time", wall), ("CPU time", cpu)) if q.get("ci95_high", 9) > goal]
    if confirmed:
        verdict += f"; confirmed in {' and '.join(confirmed)} (95% interval under {goal})"
    if unsure:
        verdict += f"; {' and '.join(unsure)} too noisy under this load to confirm"
    return verdict


def _header(r: dict[str, Any]) -> list[str]:
    quick = " (quick smoke run: not a measurement)" if r.get("quick") else ""
    return [f"Command: `{r['command']}`{quick}; {r['when']}, {_load(r)}, {r['wall_s']} s.", ""]


def overhead(r: dict[str, Any]) -> list[str]:
    w, q = r["workload"], r["ratio"]
    out = ["## Overhead over plain DeepSpeed (dp=2)", ""] + _header(r)
    out += [
        f"Model: tiny Llama, {r['model']['params'] / 1e6:.1f}M parameters; {w['world']} ranks, micro-batch {w['micro_batch']}, "
        f"{w['grad_accum']} micro-batches, {w['seq_len']} tokens, {w['tokens_per_step']} tokens/step, {w['dtype']}, ZeRO-1.",
        "",
        "| figure | dsx3d | plain DeepSpeed ZeRO-1 |",
        "|---|---|---|",
        f"| median step time (s) | {r['step_s']['dsx3d']} | {r['step_s']['deepspeed']} |",
        f"| tokens/s | {r['tokens_per_s']['dsx3d']} | {r['tokens_per_s']['deepspeed']} |",
        "",
        f"Step-time ratio dsx3d / DeepSpeed: **{q['median']:.3f}** (median of {int(q['pairs'])} alternated pairs{_ci(q)}; "
        f"quartiles {q['q1']:.3f}-{q['q3']:.3f}; ratio of means {q['ratio_of_means']:.3f}). CPU-seconds ratio (summed "
        f"over ranks, steadier under load): **{r['cpu_ratio']['median']:.3f}**{_ci(r['cpu_ratio'])} (quartiles "
        f"{r['cpu_ratio']['q1']:.3f}-{r['cpu_ratio']['q3']:.3f}). Goal <= {r['goal']}: {_goal(r)}. "
        f"Largest per-step loss difference between the two: {r['max_abs_loss_diff']:.2g} (same work).",
        "",
    ]
    return out


def alternatives(r: dict[str, Any]) -> list[str]:
    w = r["workload"]
    out = [f"## Against DDP and ZeRO-3 at {r['world']} ranks", ""] + _header(r)
    out += [
        f"Model: tiny Llama, {r['model']['params'] / 1e6:.1f}M parameters; global batch {w['global_batch']} x {w['seq_len']} tokens "
        f"({w['tokens_per_step']} tokens/step), micro-batch {w['micro_batch']}, {w['dtype']}. dsx3d's best measured layout: "
        f"**{r['dsx3d_best']}**.",
        "",
        "| contender | tokens/s | step time / DDP (median, quartiles) | tokens per CPU-second, all ranks | CPU s / DDP | peak RSS over fork, max rank (MiB) | model states, max rank (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        mem = row.get("memory")
        s = row["step_over_ddp"]
        peak = f"{mem['peak_over_fork_mib_max']:.0f}" if mem else "-"
        states = f"{mem['model_states_mib_max']:.1f}" if mem else "-"
        out.append(
            f"| {row['contender']} | {row['tokens_per_s']} | {s['median']:.2f} ({s['q1']:.2f}-{s['q3']:.2f}) | "
            f"{w['tokens_per_step'] / row['cpu_s_per_step']:.0f} | {row['cpu_over_ddp']:.2f} | {peak} | {states} |"
        )
    out += [
        "",
        f"{r['world']} ranks share the 2 cores, so wall times include time-slicing between ranks and other jobs and "
        "move from run to run; the CPU-second columns (work per step, summed over ranks) are the steadier "
        "comparison. Model states are the bytes held between steps (gradients freed); ZeRO-3 keeps parameters "
        "under its persistence threshold (10 x hidden, as transformers sets it) whole on every rank.",
        "",
    ]
    return out


def communication(key: str, r: dict[str, Any]) -> list[str]:
    lay, w = r["layout"], r["workload"]
    title = f"## Communication per step, {r.get('model_type', 'llama')}"
    ep = lay.get("ep", 1)
    title += f" dp{lay['dp']} tp{lay['tp']} pp{lay['pp']}" + (f" ep{ep}" if ep > 1 else "") + (
        ", activation checkpointing" if lay["activation_checkpointing"] else ""
    )
    out = [title, ""] + _header(r)
    out += [
        f"Micro-batch {w['micro_batch']} x {w['seq_len']} tokens, {w['grad_accum']} micro-batches, width {w['hidden']}, {w['dtype']}; "
        f"stage layers {lay['stage_layers']}; bytes one rank sends per optimizer step (ring-counted), counted over {r['steps_counted']} steps.",
        "",
        "| stage | TP counted | TP analytic | PP counted | PP analytic | DP counted / analytic | tied counted / analytic |"
        + (" EP counted / analytic (even routing) |" if ep > 1 else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if ep > 1 else ""),
    ]
    seen = set()
    for row in r["ranks"]:
        if row["stage"] in seen and ep == 1:
            continue
        seen.add(row["stage"])
        ep_cell = f" {row['ep']['measured']:.0f} / {row['ep']['analytic']:.0f} |" if ep > 1 else ""
        dp = f"{row['dp']['measured'] / row['dp']['analytic']:.5f}" if row["dp"]["analytic"] else "-"
        tied = row.get("tied", {"measured": 0, "analytic": 0})
        tied_s = (
            f"{tied['measured']:.0f} / {tied['analytic']:.0f}"
            if tied["analytic"] or tied["measured"]
            else "-"
        )
        out.append(
            f"| {row['stage']} | {row['tp']['measured']:.0f} | {row['tp']['analytic']:.0f} | {row['pp']['measured']:.0f} | "
            f"{row['pp']['analytic']:.0f} | {dp} | {tied_s} |{ep_cell}"
        )
    kinds = ["tp", "pp"] + (["tied"] if r.get("tied") else [])
    exact = ", ".join(f"{k.upper()} {'exact' if r['exact'][k] else 'differs'}" for k in kinds)
    dp_note = ""
    excess = [x for x in _dp_excess(r) if x]
    if excess:
        dp_note = (
            f" DP counted exceeds the analytic figure by {min(excess):.0f}-{max(excess):.0f} bytes per step: scalars "
            "the estimator leaves out, ZeRO-1's 4-byte gradient-norm all-reduce (every stage) and the loss (last stage)."
        )
    elif r["layout"]["dp"] > 1:
        dp_note = " DP exact."
    out += ["", f"Agreement on every rank: {exact}.{dp_note}", ""]
    if ep > 1:
        ratios = r.get("ep_measured_over_analytic", [])
        out += [
            f"EP: the all-to-all bytes each rank sends (rows to other EP ranks, and the per-expert counts before "
            f"them) are {min(ratios):.3f}-{max(ratios):.3f} of the estimator's figure, which assumes the router "
            "spreads routes evenly over the experts; one row per rank, as each rank's routes differ.",
            "",
        ]
    return out


def moe(r: dict[str, Any]) -> list[str]:
    m, w = r["model"], r["workload"]
    out = ["## Mixture of experts: what each rank holds, and the estimator", ""] + _header(r)
    out += [
        f"Model: {m['model_type']}, {m['params'] / 1e6:.2f}M parameters of which {m['expert_params'] / 1e6:.2f}M in "
        f"experts ({m['num_experts']} per layer, top-{m['experts_per_token']}), {m['layers']} layers of width {m['hidden']}, "
        f"vocabulary {m['vocab']}; {w['dtype']}, ZeRO-{w['zero_stage']}.",
        "",
        "Expert parameter bytes per rank (measured: the rank's parameters under `mlp.experts`, summed) against the "
        "whole model's bytes of the same tensors divided by tp x ep:",
        "",
        "| layout | stage | bytes per rank (every rank) | total of the stage / (tp x ep) |",
        "|---|---|---|---|",
    ]
    rows: dict[tuple[str, int], list[Any]] = {}
    for row in r["expert_bytes"]:
        rows.setdefault((row["layout"], row["stage"]), []).append(row)
    for (layout, stage), group in rows.items():
        got = sorted({row["expert_bytes"] for row in group})
        expected = sorted({row["expected_bytes"] for row in group})
        out.append(f"| {layout} | {stage} | {', '.join(f'{x:,}' for x in got)} | {', '.join(f'{x:,.0f}' for x in expected)} |")
    out += [
        "",
        f"Equal on every rank of every layout: **{'yes' if r['expert_bytes_all_equal'] else 'no'}**.",
        "",
        f"Estimator, peak memory per rank (micro-batch {w['micro_batch']} x {w['seq_len']} tokens, global batch "
        f"{w['global_batch']}; measured as `scripts/bench/memory.py` measures it). Largest error of the total: "
        f"**{_pct(r['worst_abs_error_total'])}** in absolute value (goal {100 * r['goal_abs_error']:.0f}%: "
        f"{'met' if r['meets_goal'] else 'not met'}).",
        "",
        "| layout | rank | stage | states predicted / measured (MiB) | activations predicted / measured (MiB) | total predicted / measured (MiB) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["memory_rows"]:
        p, q = row["predicted_mib"], row["measured_mib"]
        out.append(
            f"| {row['layout']} | {row['rank']} | {row['stage']} | {p['states']:.2f} / {q['states']:.2f} | "
            f"{p['activations']:.2f} / {q['activations']:.2f} | {p['total']:.2f} / {q['total']:.2f} | {_pct(row['error']['total'])} |"
        )
    acts = [row["error"]["activations"] for row in r["memory_rows"] if row["error"]["activations"] is not None]
    states = [row["error"]["states"] for row in r["memory_rows"]]
    out += [
        "",
        f"Model states agree on most ranks to round-off; on some, DeepSpeed's optimizer holds up to "
        f"{_pct(max(states))[1:]} more for a moment around the step (its expert parameter group's buffers; not "
        f"modelled). Measured activations exceed the prediction by {_pct(min(acts))[1:]} to {_pct(max(acts))[1:]}: "
        "the MoE block itself is modelled to within a few percent (measured alone: 13.2, 8.2, 15.3 and 8.2 x h values "
        "per token unsplit, at tp 2, ep 2 and tp 2 x ep 2; `dsx3d.estimate.memory`), the rest is the attention and "
        "norms, whose Korthikanti figure sits below what HF layers keep, as for the dense Llama above.",
        "",
    ]
    return out


def communication_sweep(r: dict[str, Any]) -> list[str]:
    fams = r["families"]
    built = {k: v for k, v in fams.items() if "exact" in v}
    exact = sorted(
        k for k, v in built.items() if v["exact"]["tp"] and v["exact"]["pp"] and v["exact"]["tied"]
    )
    differ = sorted(k for k in built if k not in exact)
    pp_differ = sorted(k for k, v in built.items() if not v["exact"]["pp"])
    out = ["## Communication, every family with plans (dp1 tp2 pp2, tiny configs)", ""]
    out += [
        f"Command: `{r['command']}`; {r['when']}, {_load(r)}, {r['wall_s']} s (counts do not depend on load).",
        "",
    ]
    out += [
        f"{len(built)} families run; PP bytes agree exactly for {len(built) - len(pp_differ)} of them. TP, PP and tied "
        f"bytes all agree exactly for {len(exact)}: {', '.join(exact)}.",
        "",
    ]
    if differ:
        worst = ", ".join(f"{k} ({built[k]['measured_over_analytic_max']['tp']:.5g}x)" for k in differ)
        out += [
            f"TP differs for {len(differ)} (counted over analytic, worst rank): {worst}. The estimator models one "
            "kind of decoder layer; these families mix kinds (for example dense and MoE layers, shared experts "
            "sharded next to replicated experts, linear-attention next to full-attention layers) or carry small "
            "per-layer parameters whose gradients are all-reduced; not investigated family by family.",
            "",
        ]
    out += [f"{len(fams) - len(built)} are refused by dsx3d's checker or have no buildable tiny config.", ""]
    return out


def _dp_excess(r: dict[str, Any]) -> list[float]:
    if "dp_excess_bytes" in r:
        return list(r["dp_excess_bytes"])
    return [row["dp"]["measured"] - row["dp"]["analytic"] for row in r["ranks"]]


def memory(r: dict[str, Any]) -> list[str]:
    """The estimator against measured peaks, per grid point and stage (scripts/bench/memory.py)."""
    out = ["## Estimator accuracy: peak memory per pipeline stage", ""] + _header(r)
    goal, worst, met = r["goal_abs_error"], r["worst_abs_error"], r["meets_goal"]
    figures = ", ".join(f"{k} {_pct(v)[1:]} ({'met' if met[k] else 'not met'})" for k, v in worst.items())
    out += [
        f"Llama-shaped models (MLP 2.69h, GQA), fp32 unless said, ZeRO-1, 3 optimizer steps per run, the stage's "
        f"fullest rank. Largest error in absolute value against the goal of {100 * goal:.0f}%: {figures}. "
        "`allocated` is the allocator's high-water of live tensor bytes (what a GPU reports as max_memory_allocated; "
        "on CPU from torch.profiler's memory events); `rss net` is the resident-set high-water over the RSS at the "
        "fork, less the same figure for the same layout with a negligible model (the runtime's own footprint).",
        "",
        "| grid point | stage | predicted MiB (states + activations + transient) | peak phase | allocated MiB | error | rss net MiB | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        p, m, e = row["predicted_mib"], row["measured_mib"], row["error"]
        split = (
            f"{p['total']:.1f} ({p['states']:.1f} + {p['activations']:.1f} + {p['transient']:.1f})" if "states" in p else f"{p['total']:.1f}"
        )
        rss = f"{m['rss_net']:.1f} | {_pct(e['rss_net'])}" if "rss_net" in m else "- | -"
        out.append(
            f"| {row['point']} | {row['stage']} | {split} | {p['phase']} | {m['allocated']:.1f} | {_pct(e['allocated'])} | {rss} |"
        )
    out.append("")
    return out


def tp_minimum(r: dict[str, Any]) -> list[str]:
    """Issue 12: step time of the TP variants against the engine before and DeepSpeed's TP; SP memory/bytes."""
    w, m = r["workload"], r["model"]
    out = ["## Tensor parallelism at Megatron's communication minimum", ""] + _header(r)
    out += [
        f"Llama, hidden {m['hidden']}, {m['layers']} layers, vocabulary {m['vocab']} ({m['params'] / 1e6:.1f}M parameters); "
        f"micro-batch {w['micro_batch']} x {w['seq_len']} tokens, global batch {w['global_batch']}, {w['dtype']}. "
        "`before`: one TP entry per projection, synchronous (`TPContext(shared_entries=False, overlap=False)`); `shared`: one entry per "
        "distinct input; `+overlap`: its collective asynchronous under the weight gradient; `sp`: the default, with "
        "sequence parallelism; `deepspeed`: DeepSpeed's own TP layers in a hand-written PipelineModule "
        "(`+overlap`: its `tp_overlap_comm`). Ratios are medians of per-round ratios (under 1: faster).",
        "",
        "| layout | contender | step s | wall / before | CPU / before | wall / deepspeed | CPU / deepspeed | max loss diff vs before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in r["timing"]:
        lay = t["layout"]
        name = f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']}"
        for c, row in t["contenders"].items():
            out.append(
                f"| {name} | {c} | {row['step_s']:.3f} | {row['wall_over_before']['median']:.3f} | {row['cpu_over_before']['median']:.3f} | "
                f"{row['wall_over_deepspeed']['median']:.3f} | {row['cpu_over_deepspeed']['median']:.3f} | {row['max_abs_loss_diff_vs_before']:.1e} |"
            )
    sp_cpu = [t["contenders"]["sp"]["cpu_over_before"]["median"] for t in r["timing"] if "sp" in t["contenders"]]
    shared_cpu = [t["contenders"]["shared+overlap"]["cpu_over_before"]["median"] for t in r["timing"] if "shared+overlap" in t["contenders"]]
    if sp_cpu and shared_cpu:
        out += [
            "",
            f"One input-gradient collective per distinct input (`shared`, `+overlap`) takes {min(shared_cpu):.2f}-{max(shared_cpu):.2f}x "
            f"the CPU of the engine before. Sequence parallelism (`sp`, the default) costs {min(sp_cpu):.2f}-{max(sp_cpu):.2f}x here: "
            "on gloo a reduce-scatter plus an all-gather (and the copies that cut and join the shards) cost more than the "
            "all-reduce they replace, while on NCCL they move the same bytes (Korthikanti et al. 2022). What it buys is below: "
            "activation memory and pipeline bytes. On a CPU box `parallel.sequence_parallel: false` is the faster setting.",
        ]
    mem = r.get("memory")
    if mem:
        msg = mem["hidden_message_bytes"]
        out += [
            "",
            f"Sequence parallelism at dp1 tp2 pp2: largest pipeline message {msg['sp_off']} bytes without, {msg['sp_on']} with "
            f"(ratio {msg['ratio']:.3f}, expected {msg['expected_ratio']}); bytes autograd saves for backward, high-water per rank:",
            "",
            "| rank | stage | saved MiB, SP off | saved MiB, SP on | on / off |",
            "|---|---|---|---|---|",
        ]
        for rank in mem["ranks"]:
            sh = rank["saved_high_mib"]
            out.append(f"| {rank['rank']} | {rank['stage']} | {sh['sp_off']:.2f} | {sh['sp_on']:.2f} | {rank['saved_high_sp_over_off']:.3f} |")
    out.append("")
    return out


def gpu(r: dict[str, Any]) -> list[str]:
    out = [
        "## GPU: 1B-class Llama, bf16, tp=1 pp=1",
        "",
        f"Command: `{r['command']}`; {r['device']}, {r['when']}.",
        "",
    ]
    out += ["| contender | step (s) | tokens/s | MFU |", "|---|---|---|---|"]
    for name, row in r["contenders"].items():
        out.append(f"| {name} | {row['step_s']} | {row['tokens_per_s']} | {row['mfu']:.3f} |")
    out.append("")
    return out


METHODS = """## How the figures are measured

- **Timing.** Contenders live in the same forked ranks and are stepped round-robin, the order reversed every
  round (A B, B A, ...), with a barrier before each step; a step's time is the slowest rank's wall time from
  the barrier. Ratios are medians of per-round ratios (quartiles given), because absolute times on this
  shared machine move with other jobs' load. CPU seconds per step (`time.process_time`, summed over ranks)
  are given next to wall time: they leave out time lost to other jobs and time blocked on peers. Every
  contender starts from the same weights and sees the same batches; equal first-step losses show it.
- **Overhead** (`scripts/bench/overhead.py`): dsx3d at dp=2 and `deepspeed.initialize` on the plain HF
  model with the same DeepSpeed JSON (ZeRO-1, AdamW, clipping, the same micro-batch and accumulation). Since
  pp = 1 runs on DeepSpeed's regular engine, both contenders use that engine; the figures above were
  measured before, with dsx3d on a one-stage PipelineEngine, and have not been re-measured.
- **Alternatives** (`scripts/bench/alternatives.py`): torch DDP (through `scripts.bench.ddp.wrap_ddp`, torch
  AdamW, `no_sync` accumulation, clipping) and HF-style ZeRO-3 (`deepspeed.initialize`, stage 3, the bucket
  and persistence sizes transformers fills in for "auto") on the plain HF model, and dsx3d under a few
  layouts, at equal world size and global batch. Peak memory: each of DDP, ZeRO-3 and dsx3d's fastest layout
  alone in freshly forked ranks; RSS high-water (/proc/self/status VmHWM, reset with /proc/self/clear_refs
  right after the fork) minus the RSS at the fork (the forked parent's libraries are shared), over build
  and two steps; model states = distinct parameter, gradient and optimizer-state storages after the steps.
- **Bubble** (`scripts/bench/bubble.py`): every PipelineEngine instruction is timed by
  `dsx3d.pipeline.stage_clock.StageClock` (wall span and CPU time). Busy = F, B and W passes (the loss is in the
  last stage's forward); the window runs from the barrier to the last pass on any stage (gradient reduction
  and optimizer step are not pipeline time); idle = 1 - busy / window, also replayed with CPU times as
  durations. p = 4 runs 4 processes on 2 cores: they time-slice, so its wall figures are the least reliable.
- **Communication** (`scripts/bench/comm.py`): `bench.counting.CommCounter` wraps the ProcessGroup
  methods every torch.distributed call ends in (DeepSpeed's included), recording op, group ranks and buffer
  bytes; a call is attributed to TP, DP, PP (send/recv between adjacent stages) or the tied pair by its
  ranks. Bytes one rank sends, ring-counted: all-reduce 2(g-1)/g of the buffer, all-gather (g-1)/g, send all
  of it. The warm-up step (DeepSpeed exchanges tensor shapes once) is not counted. TP and PP agreement is a
  test: `tests/e2e/test_bench_smoke.py`. The first count disagreed with the estimator, which was wrong twice:
  it took Megatron's 4 TP all-reduces per layer where dsx3d then sharded each HF projection with its own `f`
  (2 forward, 5 backward; with shared entries the projections reading one input share one: 2 + 2), and it
  left out the vocab-parallel ends
  (embedding all-reduce, head input gradient, the cross-entropy's three fp32 all-reduces) and the int64
  token ids that travel with the activations between stages. `dsx3d.estimate` now counts these from the
  family's TP plan (with the all-gathers of `colwise_gather_output` / `rowwise_split_input` styles and the
  q/k-norm gradients); the per-family sweep above says where it agrees to the byte.
- **Estimator accuracy** (`scripts/bench/memory.py`): per grid point (model size, layout, sequence
  parallelism, bf16, DeepSpeed's default bucket, checkpointing), each stage's fullest rank: the allocator's
  high-water of live tensor bytes from the engine build to the end of 3 steps (on CPU summed from
  torch.profiler's memory events, every allocation and free; on a GPU `torch.cuda.max_memory_allocated`),
  and in a separate run the resident-set high-water net of the runtime's own footprint (the same layout with
  a negligible model). The estimate is `dsx3d.estimate` for the same setup (its stage peak: the larger of
  the backward and the optimizer phase, transients included).
- **TP minimum** (`scripts/bench/tp.py`): the TP variants (one entry per projection, shared entries, overlap,
  sequence parallelism) and DeepSpeed's own TP layers in the same ranks, alternated step by step; the
  sequence-parallel memory and pipeline-message figures in fresh ranks, SP off then on.
- **MoE** (`scripts/bench/moe.py`): expert bytes per rank as built by the engine (no training), and the
  memory census above on an MoE model with and without expert parallelism.
- **Context parallelism** (`scripts/bench/context_parallel.py`): memory as each rank's peak RSS over a step
  above its RSS before it, cp 1 and cp 2 runs alternated in fresh ranks; the budget search in fresh process
  groups, a rank ended by a watchdog once over budget; step time with both layouts' engines in the same 2 ranks,
  alternated, `deepspeed.comm.all_to_all_single` wrapped with a timer (the all-to-all share).
- **Checkpoint saves** (`scripts/bench/async_save.py`): one engine and one Checkpointer in 2 ranks; windows of a
  step (with a save or without: a save without checksums or manifest, the default save, an asynchronous one),
  plain steps and the wait for the save, alternated; the saving steps against each other and the whole window
  against a plain window, per round.
- **GPU** (`bash scripts/bench/gpu.sh`): bf16 tokens/s and MFU of a 1.1B Llama (Llama-3.2-1B's shape,
  32k vocabulary, untied) through dsx3d at tp=1 pp=1 against `deepspeed.initialize` on the plain HF model
  with the same JSON and against the plain HF model with torch AdamW in bf16, alternated in one process;
  then `scripts/bench/memory.py --device cuda`: the estimator's peak against `torch.cuda.max_memory_allocated`
  at world size 1 (bf16 and fp32, 1-2B-class shapes, DeepSpeed's default bucket); `DSX3D_GPU_MEMORY=0` skips it.
"""


COMMANDS = """## Reproducing

    source scripts/env.sh
    python -m scripts.bench.overhead        # about 1-2 min each on 2 cores; --quick for a smoke run
    python -m scripts.bench.alternatives
    python -m scripts.bench.bubble
    python -m scripts.bench.comm            # also --checkpointing, --family qwen3 --dp 1, ...
    python -m scripts.bench.memory
    python -m scripts.bench.moe             # MoE: expert bytes per rank, estimator memory (about 5 min)
    python -m scripts.bench.lora            # LoRA vs full fine-tuning: optimizer and gradient bytes per rank
    python -m scripts.bench.packing         # packed SFT rows vs padded examples: non-padding tokens/s
    python -m scripts.bench.tiled_loss      # last-stage peak memory, tiled logits and loss vs full logits
    python -m scripts.bench.context_parallel  # cp: activation memory, seq_len within a budget, step time (about 6 min)
    python -m scripts.bench.comm --family mixtral --ep 2    # MoE TP and all-to-all bytes
    python -m scripts.bench.async_save      # a save's step-time cost: manifest vs none, sync vs train.async_save
    python -m scripts.bench.report          # this section, from scripts/bench/results.json
    bash scripts/bench/gpu.sh               # on a CUDA machine

Each script prints its result as JSON and merges it into scripts/bench/results.json (`--no-write` to skip).
"""


def lora(r: dict[str, Any]) -> list[str]:
    lay, cfg = r["layout"], r["lora"]
    out = [f"## LoRA against full fine-tuning: optimizer and gradient memory per rank (dp{lay['dp']} tp{lay['tp']} pp{lay['pp']})", ""]
    out += _header(r)
    out += [
        f"Model: the tiny benchmark Llama (7.1M parameters), fp32, ZeRO-1; LoRA rank {cfg['r']} on "
        f"{', '.join(cfg['target_modules'])}. Bytes read from the DeepSpeed engine at the optimizer step of each rank "
        "(Adam's moments; the fp32 partitions the optimizer updates; the gradients present), largest rank:",
        "",
        "| figure | full fine-tuning | LoRA | LoRA / full |",
        "|---|---|---|---|",
    ]
    names = {
        "optimizer_state_bytes": "optimizer state (Adam moments)",
        "optimizer_param_bytes": "optimizer's fp32 parameter partitions",
        "grad_bytes": "gradients",
        "trainable_params": "trainable parameters (count)",
    }
    for key, name in names.items():
        full, mine = max(r["full"][key]), max(r["lora_run"][key])
        out.append(f"| {name} | {full:,} | {mine:,} | **{r['ratio_lora_over_full'][key]:.4f}** |")
    out.append("")
    return out


def render(results: dict[str, Any]) -> str:
    lines = ["# Benchmarks", ""]
    first = next((v for v in results.values() if isinstance(v, dict) and "machine" in v), None)
    if first:
        m, v = first["machine"], first["versions"]
        lines += [
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, {m['os']}, Python {m['python']}; "
            f"torch {v['torch']}, deepspeed {v['deepspeed']}, transformers {v['transformers']}, accelerate {v['accelerate']}; "
            f"gloo, one thread per rank, ranks forked by dsx3d.verify.harness. The machine was shared with other jobs: the load "
            f"average (2 cores) is given with every figure, and every comparison alternates its contenders step by step in the "
            f"same ranks (A B B A ..., a barrier before each step) and reports ratios.",
            "",
        ]
    renderers = {
        "overhead": overhead,
        "alternatives": alternatives,
        "tp_minimum": tp_minimum,
        "estimator_memory": memory,
        "moe": moe,
        "lora_memory": lora,
        "packing": packing,
        "tiled_loss": tiled_loss,
        "context_parallel": context_parallel,
        "async_save": async_save,
        "gpu": gpu,
        "verify_sweep": verify_sweep,
    }
    order = [
        "overhead",
        "alternatives",
        "tp_minimum",
        "bubble",
        "pipeline_peer",
        "communication",
        "estimator_memory",
        "moe",
        "lora_memory",
        "packing",
        "tiled_loss",
        "context_parallel",
        "async_save",
        "gpu",
        "verify_sweep",
    ]

    def rank(key: str) -> tuple[int, str]:
        return next((i for i, prefix in enumerate(order) if key.startswith(prefix)), len(order)), key

    for key in sorted(results, key=rank):
        r = results[key]
        if key in renderers:
            lines += renderers[key](r)
        elif key.startswith("bubble"):
            lines += bubble(r, _header(r))
        elif key == "pipeline_peer":
            lines += pipeline_peer(r, _header(r))
        elif key == "communication_sweep":
            lines += communication_sweep(r)
        elif key.startswith("communication"):
            lines += communication(key, r)
    if "gpu" not in results:
        lines += [
            "## GPU",
            "",
            "Not measured yet (no GPU here). On a CUDA machine: `bash scripts/bench/gpu.sh`.",
            "",
        ]
    lines.append(METHODS)
    lines.append(COMMANDS)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", default=str(PAGE), help="the page to write (default docs/benchmarks.md); - for stdout")
    args = parser.parse_args(argv)
    text = render(json.loads(args.results.read_text()))
    if args.out == "-":
        print(text, end="")
    else:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
