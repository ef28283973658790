"""Pipeline bubble: 1F1B, zb-h1 (the ZB-H1 order for equal costs), zb-h1 with `zb_costs: auto` (the
cost-aware order built from the F, B, W durations the engine measured in its second and third steps) and
interleaved 1F1B at v = 2 and 4 chunks per rank, and ZB-V (two chunks per rank in a V; equal or measured
costs), at p = 2 and 4.

Method. For each p, one engine per (schedule, m) (pp = p, dp = tp = 1, same model, micro-batch and split) is
built in the same p forked ranks; all are stepped in every round, the order reversed every other round
(A B C ... C B A: load drift hits every schedule alike), a barrier before each step. Each engine carries a
`dsx3d.pipeline.stage_clock.StageClock`: every instruction's wall span and CPU time. A stage is busy while it
runs F, B or W (the loss is part of the last stage's F); everything else in the step is idle: waiting in a
receive or a send, loading micro-batches, the engine's other instructions and the dispatch between
instructions. The pipeline window of a step runs from the moment all ranks have left the barrier to the end
of the last pass on any stage (the gradient reduce and optimizer step after it are not pipeline time).
Idle fraction of stage s = 1 - busy_s / window, averaged over the timed steps, also replayed with each
instruction's CPU time as its duration (`replay.py`: what the order gives without the wait for a core that
dominates wall time on an oversubscribed machine). Bounds per row: `analytic` (the schedule's own: 1F1B's
(p-1)/(m+p-1), ZB-H1's for equal costs, the cost-aware order simulated with the measured costs) and
`simulated` (the row's order simulated with the per-stage CPU costs measured in this run, no transfer time).
Step ratios are per round (new / 1F1B at the same m, both stepped in that round): median and range.
Peak memory: each rank's peak RSS during the step over its RSS at the step's start (run with
MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the RSS).

    python -m scripts.bench.bubble [--quick] [--pp 2 4] [--micro-batches 4 8 16] [--rounds N] [--no-write]
        [--stage-layers 2 1 1 0]   (an explicit split for the p it fits; results under their own key)
        [--schedules 1f1b interleaved-v2 interleaved-v4 zb-v zb-v-auto --layers 16 --vocab 1024]   (chunked rows)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from dsx3d.distributed import comm
from dsx3d.pipeline.registry import get_schedule
from dsx3d.pipeline.stage_clock import StageClock
from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc
from scripts.bench.bubble_figures import compare, stage_figures

SCHEDULES: dict[str, tuple[str, str | None, int]] = {  # row name: (parallel.schedule, zb_costs, virtual stages)
    "1f1b": ("1f1b", None, 1),
    "zb-h1": ("zb-h1", None, 1),
    "zb-h1-auto": ("zb-h1", "auto", 1),
    "interleaved-v2": ("interleaved-1f1b", None, 2),
    "interleaved-v4": ("interleaved-1f1b", None, 4),
    "zb-v": ("zb-v", None, 2),
    "zb-v-auto": ("zb-v", "auto", 2),
}
DEFAULT_SCHEDULES = ("1f1b", "zb-h1", "zb-h1-auto")
"""The interleaved rows need p v decoder layers (`--layers`) and m a multiple of p, the zb-v rows 2p layers: named
with --schedules."""


def _key(schedule: str, m: int) -> str:
    return f"{schedule}:m{m}"


def worker(
    rank: int, works: dict[int, bc.Workload], state: dict[str, torch.Tensor], pp: int, rounds: int, warmup: int,
    schedules: tuple[str, ...], stage_layers: list[int] | None = None,
) -> dict[str, Any]:
    contenders, clocks, batches = [], {}, {}
    for name in schedules:
        schedule, costs, v = SCHEDULES[name]
        for m, work in works.items():
            c = bc.dsx3d_contender(
                _key(name, m), work, state, dp=1, pp=pp, schedule=schedule, zb_costs=costs, stage_layers=stage_layers,
                virtual_stages=v,
            )
            clocks[c.name] = StageClock(c.engine.ds_engine)
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
    measured = {c.name: getattr(c.engine.ds_engine, "dsx3d_zb_costs", None) for c in contenders}
    return {"stage": c.engine.placement.pp, "steps": steps, "costs": measured}


def run_pp(
    p: int, config: Any, seq: int, ms: list[int], rounds: int, schedules: tuple[str, ...], state: Any,
    stage_layers: list[int] | None = None,
) -> dict[str, Any]:
    works = {m: bc.Workload(config, micro_batch=2, seq_len=seq, global_batch=2 * m) for m in ms}
    per_rank = run_ranks(worker, p, works, state, p, rounds, 4, schedules, stage_layers, timeout_s=3000)
    per_rank.sort(key=lambda r: r["stage"])
    rows = [
        {"schedule": name, "p": p, "m": m, **stage_figures(per_rank, _key(name, m), m, get_schedule(SCHEDULES[name][0]).placement)}
        for name in schedules
        for m in works
    ]
    compare(rows, per_rank, {name: SCHEDULES[name] for name in schedules})
    from dsx3d.pipeline.module import stage_bounds

    return {"stage_bounds": stage_bounds(config, p, seq, stage_layers), "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke run")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline stages (ranks); p > cores oversubscribes")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 8, quick 2)")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="m values")
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(DEFAULT_SCHEDULES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; interleaved rows need p v)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 8192)")
    parser.add_argument("--hidden", type=int, default=None, help="width (default 256; the MLP 2.6875 times it, as the default's)")
    parser.add_argument("--stage-layers", type=int, nargs="+", default=None,
                        help="parallel.stage_layers for the p with that many stages (default: the cost-balanced split)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 8)
    shape = {k: v for k, v in (("num_hidden_layers", args.layers), ("vocab_size", args.vocab)) if v}
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=args.hidden * 688 // 256)
    config = bc.bench_config(args.quick, **shape)
    seq = 32 if args.quick else 128
    warm_up()
    state = bc.make_state(config)
    with bc.provenance(args.quick) as meta:
        runs = {
            str(p): run_pp(
                p, config, seq, args.micro_batches, rounds, tuple(args.schedules), state,
                args.stage_layers if args.stage_layers and len(args.stage_layers) == p else None,
            )
            for p in args.pp
        }
    result = {
        **meta,
        "what": "idle fraction per pipeline stage of each schedule (1F1B, zb-h1, zb-h1 with measured costs, interleaved "
        "1F1B at v chunks per rank, ZB-V), against each order's bound",
        "cores": len(__import__("os").sched_getaffinity(0)),
        "workload": {
            "micro_batch": 2, "seq_len": seq, "dtype": "fp32",
            "hidden": config.hidden_size, "layers": config.num_hidden_layers, "vocab": config.vocab_size,
        },
        "rounds": rounds,
        "stage_layers": args.stage_layers,
        "runs": runs,
    }
    key = "bubble" + ("_stage_layers_" + "_".join(map(str, args.stage_layers)) if args.stage_layers else "")
    key += "".join(f"_{k}{v}" for k, v in (("layers", args.layers), ("vocab", args.vocab), ("hidden", args.hidden)) if v)
    bc.emit(key, result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
