"""Pipeline bubble: measured idle fraction per stage against (p-1)/(m+p-1), for m = p, 2p and 4p.

Method. One engine per m (pp=p, dp=tp=1, same model, micro-batch and stage split) is built in the same p
ranks; they are stepped alternately (round-robin, order reversed every round, a barrier before each step).
Every schedule instruction the DeepSpeed PipelineEngine executes is timed (`bench_common.InstructionClock`
wraps the engine's instruction table). A stage is busy while it runs ForwardPass or BackwardPass (the
loss is part of the last stage's forward); everything else inside the step (waiting in send/recv, loading
micro-batches) is idle. The pipeline window of a step runs from the moment all ranks have left the barrier
to the end of the last BackwardPass on any stage; the gradient reduction and optimizer step after it are
not pipeline time. Idle fraction of stage s = 1 - busy_s / window, averaged over the timed steps. The
analytic figure assumes equally loaded stages; the measured per-micro-batch busy time of each stage is
reported so an imbalance can be seen. Each instruction's CPU time is recorded too: per part (F, B, W) per
micro-batch, summed per step, and a replay of every step with CPU times as durations (`replay.py`), which is
what the schedule gives without the waiting for a core that dominates wall time on an oversubscribed machine.
Peak memory: each rank's peak RSS during the step over its RSS at the step's start (VmHWM reset before each
step; run with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the RSS).

    python -m scripts.bench.bubble [--quick] [--pp 2] [--rounds N] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dsx3d.distributed import comm
from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc
from scripts.bench.replay import replay

BUSY = ("ForwardPass", "BackwardPass", "BackwardInput", "BackwardWeight")
SCHEDULES = ("1f1b", "zb-h1")


def _key(schedule: str, m: int) -> str:
    return f"{schedule}:m{m}"


def worker(
    rank: int,
    works: dict[int, bc.Workload],
    state: dict[str, torch.Tensor],
    pp: int,
    rounds: int,
    warmup: int,
    schedules: tuple[str, ...] = SCHEDULES,
    zb_costs: tuple[float, float, float] | None = None,
) -> dict[str, Any]:
    contenders, clocks, batches = [], {}, {}
    for schedule in schedules:
        for m, work in works.items():
            c = bc.dsx3d_contender(_key(schedule, m), work, state, dp=1, pp=pp, schedule=schedule, zb_costs=zb_costs)
            clocks[c.name] = bc.InstructionClock(c.engine.ds_engine)
            contenders.append(c)
            batches[c.name] = bc.make_batches(work, warmup + rounds)
    steps: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
    for r in range(warmup + rounds):
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            clocks[c.name].take()
            comm.barrier()
            rss = bc.proc_status_kb("VmRSS") if bc.reset_peak_rss() else None
            t0 = time.perf_counter()
            c.step(batches[c.name][r])
            events = clocks[c.name].take()
            peak = None if rss is None else bc.proc_status_kb("VmHWM") - rss
            if r >= warmup:
                steps[c.name].append({"start": t0, "events": events, "peak_kb": peak})
    return {"stage": c.engine.placement.pp, "steps": steps}


PARTS = {"F": ("ForwardPass",), "B": ("BackwardPass", "BackwardInput"), "W": ("BackwardWeight",)}


def stage_figures(per_rank: list[dict[str, Any]], name: str, m: int) -> dict[str, Any]:
    """Idle fraction per stage, averaged over steps (see the module docstring); busy wall and CPU time per
    micro-batch of each part (F, B: the whole backward under 1F1B, W), and the step's peak RSS over its start."""
    n_steps = len(per_rank[0]["steps"][name])
    stages = sorted(r["stage"] for r in per_rank)
    idle: dict[int, list[float]] = {s: [] for s in stages}
    busy_per_mb: dict[int, list[float]] = {s: [] for s in stages}
    parts: dict[tuple[int, str, int], list[float]] = {}  # (stage, part, 0 wall / 1 cpu) -> per step
    peaks: dict[int, list[int]] = {s: [] for s in stages}
    windows, cpu_steps, replayed = [], [], []
    for i in range(n_steps):
        replayed.append(
            replay({r["stage"]: [(k, c) for k, _, _, c in r["steps"][name][i]["events"]] for r in per_rank})
        )
        start = max(r["steps"][name][i]["start"] for r in per_rank)
        end = max(
            e for r in per_rank for (kind, _, e, _) in r["steps"][name][i]["events"] if kind in BUSY[1:]
        )
        windows.append(end - start)
        cpu_step = 0.0
        for r in per_rank:
            st, events = r["stage"], r["steps"][name][i]["events"]
            busy = sum(e - b for kind, b, e, _ in events if kind in BUSY)
            idle[st].append(1 - busy / (end - start))
            busy_per_mb[st].append(busy / m)
            for part, kinds in PARTS.items():
                chosen = [(e - b, c) for kind, b, e, c in events if kind in kinds]
                parts.setdefault((st, part, 0), []).append(sum(w for w, _ in chosen) / m)
                parts.setdefault((st, part, 1), []).append(sum(c for _, c in chosen) / m)
            cpu_step += sum(c for kind, _, _, c in events if kind in BUSY)
            if r["steps"][name][i]["peak_kb"] is not None:
                peaks[st].append(r["steps"][name][i]["peak_kb"])
        cpu_steps.append(cpu_step)

    def ms(values: list[float]) -> float:
        return bc.rounded(1e3 * statistics.median(values), 3)

    return {
        "idle_per_stage": [bc.rounded(statistics.fmean(idle[s]), 3) for s in stages],
        "idle_mean": bc.rounded(statistics.fmean(statistics.fmean(v) for v in idle.values()), 3),
        "busy_ms_per_micro_batch": [ms(busy_per_mb[s]) for s in stages],
        "part_ms_per_micro_batch": {
            part: {"wall": [ms(parts[(s, part, 0)]) for s in stages], "cpu": [ms(parts[(s, part, 1)]) for s in stages]}
            for part in PARTS
        },
        "busy_cpu_ms_per_step": ms(cpu_steps),
        "peak_mib_over_step_start": [
            bc.rounded(max(peaks[s]) / 1024, 3) if peaks[s] else None for s in stages
        ],
        "window_ms": ms(windows),
        "replayed": {  # the same steps replayed with CPU times as durations (scripts/bench/replay.py)
            "idle_per_stage": [
                bc.rounded(statistics.fmean(1 - x["busy"][s] / x["window"] for x in replayed), 3) for s in stages
            ],
            "window_ms": ms([x["window"] for x in replayed]),
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke run")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks); p > cores oversubscribes")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 8, quick 2)")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=None, help="m values (default p, 2p, 4p)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--zb-costs", type=float, nargs=3, default=None, metavar=("F", "B", "W"),
                        help="relative F, B, W durations zb-h1's order is built for (parallel.zb_costs)")
    args = parser.parse_args(argv)
    rounds, warmup, p = args.rounds or (2 if args.quick else 8), 1, args.pp
    config = bc.bench_config(args.quick)
    seq = 32 if args.quick else 128
    works = {
        m: bc.Workload(config, micro_batch=2, seq_len=seq, global_batch=2 * m)
        for m in (args.micro_batches or (p, 2 * p, 4 * p))
    }
    schedules = tuple(args.schedules)
    zb_tuple = tuple(args.zb_costs) if args.zb_costs else None
    warm_up()
    state = bc.make_state(config)
    with bc.provenance(args.quick) as meta:
        per_rank = run_ranks(worker, p, works, state, p, rounds, warmup, schedules, zb_tuple, timeout_s=1800)
    from dsx3d.estimate.schedules import schedule_bubble

    rows = []
    for schedule in schedules:
        for m in works:
            figures = stage_figures(per_rank, _key(schedule, m), m)
            rows.append({
                "schedule": schedule, "p": p, "m": m,
                "analytic": bc.rounded(schedule_bubble(schedule, p, m, zb_tuple), 3),
                "analytic_1f1b": bc.rounded((p - 1) / (m + p - 1), 3),
                **figures,
            })
    base = {r["m"]: r for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        if r["schedule"] != "1f1b" and r["m"] in base:
            b = base[r["m"]]
            r["window_ratio_vs_1f1b"] = bc.rounded(r["window_ms"] / b["window_ms"], 3)
            r["replayed"]["window_ratio_vs_1f1b"] = bc.rounded(
                r["replayed"]["window_ms"] / b["replayed"]["window_ms"], 3
            )
            r["busy_cpu_ratio_vs_1f1b"] = bc.rounded(r["busy_cpu_ms_per_step"] / b["busy_cpu_ms_per_step"], 3)
            r["peak_ratio_vs_1f1b"] = [
                bc.rounded(z / o, 3) if z and o else None
                for z, o in zip(r["peak_mib_over_step_start"], b["peak_mib_over_step_start"], strict=True)
            ]
    from dsx3d.models.pipeline import stage_bounds

    bounds = stage_bounds(config, p, seq, None)
    result = {
        **meta,
        "what": "idle fraction per pipeline stage (1 - forward/backward time / pipeline window) vs (p-1)/(m+p-1)",
        "pp": p,
        "stage_bounds": bounds,
        "workload": {
            "micro_batch": 2,
            "seq_len": seq,
            "dtype": "fp32",
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "vocab": config.vocab_size,
        },
        "rounds": rounds,
        "rows": rows,
    }
    bc.emit(f"bubble_pp{p}", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
