"""dsx3d against what users would pick instead, at equal world size and model: plain torch DDP and HF-style
DeepSpeed ZeRO-3 (`deepspeed.initialize` with stage 3 on the plain HF model), tokens/s and peak memory per rank.

Throughput: every contender (DDP, ZeRO-3 and dsx3d under a few layouts) is built in the same ranks and
they are stepped round-robin (order reversed every round, a barrier before each step) on the same global
batch; tokens/s = tokens per step / median step time, and each contender's step time over DDP's in the same
round (median of per-round ratios). dsx3d's best layout is the fastest measured one.
Memory: DDP, ZeRO-3 and dsx3d's best layout are then run alone, each in freshly forked ranks: the RSS
high-water (/proc/self/status VmHWM, reset right after the fork) over the RSS at the fork, during build and
training steps, and the model-state bytes (distinct parameter, gradient and optimizer-state storages).

    python -m scripts.bench.alternatives [--quick] [--world 4] [--rounds N] [--no-write]
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc
from scripts.bench.memory import census


def layouts(world: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) candidates: pure DP, and 2-way TP and/or PP with DP over the rest."""
    out = [(world, 1, 1)]
    if world % 2 == 0:
        out += [(world // 2, 1, 2), (world // 2, 2, 1)]
    if world % 4 == 0:
        out += [(world // 4, 2, 2)]
    return out


def build(name: str, work: bc.Workload, state: dict[str, torch.Tensor]) -> bc.Contender:
    if name == "ddp":
        return bc.ddp_contender(name, work, state)
    if name == "zero3":
        return bc.hf_deepspeed_contender(name, work, state, zero_stage=3)
    dp, tp, pp = (int(x[2:]) for x in name.split()[1:])
    return bc.dsx3d_contender(name, work, state, dp=dp, tp=tp, pp=pp)


def label(dims: tuple[int, int, int]) -> str:
    dp, tp, pp = dims
    return f"dsx3d dp{dp} tp{tp} pp{pp}"


def throughput_worker(
    rank: int, names: list[str], work: bc.Workload, state: dict[str, torch.Tensor], rounds: int
) -> dict[str, Any]:
    contenders = [build(n, work, state) for n in names]
    return bc.alternate(contenders, bc.make_batches(work, rounds + 1), rounds, warmup=1)


def memory_worker(
    rank: int, name: str, work: bc.Workload, state: dict[str, torch.Tensor], steps: int
) -> dict[str, Any]:
    gc.collect()
    base = bc.proc_status_kb("VmRSS")
    bc.reset_peak_rss()
    c = build(name, work, state)
    built = bc.proc_status_kb("VmRSS")
    for batch in bc.make_batches(work, steps):
        c.step(batch)
    peak = bc.proc_status_kb("VmHWM")
    if name == "ddp":
        states = _ddp_states(c)
    else:
        engine = c.engine.ds_engine if name.startswith("dsx3d") else c.engine
        states = {k: sum(v.values()) for k, v in census(engine).items()}
    return {
        "base_mib": base / 1024,
        "build_mib": (built - base) / 1024,
        "peak_over_base_mib": (peak - base) / 1024,
        "peak_mib": peak / 1024,
        "states_mib": {k: v / 2**20 for k, v in states.items()},
    }


def _ddp_states(c: bc.Contender) -> dict[str, int]:
    """Model-state bytes of the DDP contender: module parameters, their gradients, AdamW's state."""
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out[kind] += s.nbytes()

    module = c.engine.module
    for p in module.parameters():
        add("params", p)
    for p in module.parameters():
        if p.grad is not None:
            add("grads", p.grad)
    for state in c.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                add("optimizer", v)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke run")
    parser.add_argument("--world", type=int, default=4, help="ranks (every contender uses all of them)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 6, quick 2)")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    rounds, world = args.rounds or (2 if args.quick else 6), args.world
    config = bc.bench_config(args.quick)
    work = bc.Workload(config, micro_batch=1, seq_len=32 if args.quick else 128, global_batch=2 * world)
    warm_up()
    state = bc.make_state(config)
    names = ["ddp", "zero3", *(label(d) for d in layouts(world))]
    with bc.provenance(args.quick) as meta:
        per_rank = run_ranks(throughput_worker, world, names, work, state, rounds, timeout_s=1200)
        times = {n: bc.step_times(per_rank, n) for n in names}
        cpu = {n: bc.step_cpu(per_rank, n) for n in names}
        speed = {n: work.tokens_per_step / statistics.median(times[n]) for n in names}
        best = max((n for n in names if n.startswith("dsx3d")), key=lambda n: speed[n])
        memory = {
            n: run_ranks(memory_worker, world, n, work, state, 2, timeout_s=600)
            for n in ("ddp", "zero3", best)
        }
    losses = per_rank[0]
    rows = []
    for n in names:
        row: dict[str, Any] = {
            "contender": n,
            "tokens_per_s": round(speed[n]),
            "step_s": bc.rounded(statistics.median(times[n])),
            "step_over_ddp": {k: bc.rounded(v) for k, v in bc.ratio_summary(times["ddp"], times[n]).items()},
            "cpu_s_per_step": bc.rounded(statistics.median(cpu[n])),
            "cpu_over_ddp": bc.rounded(bc.ratio_summary(cpu["ddp"], cpu[n])["median"]),
            "first_loss": bc.rounded(losses[n]["loss"][0], 6),
        }
        if n in memory:
            ranks = memory[n]
            row["memory"] = {
                "peak_over_fork_mib_max": bc.rounded(max(r["peak_over_base_mib"] for r in ranks)),
                "peak_over_fork_mib_per_rank": [bc.rounded(r["peak_over_base_mib"]) for r in ranks],
                "peak_rss_mib_max": bc.rounded(max(r["peak_mib"] for r in ranks)),
                "model_states_mib_max": bc.rounded(max(sum(r["states_mib"].values()) for r in ranks)),
                "model_states_by_kind_rank0": {k: bc.rounded(v) for k, v in ranks[0]["states_mib"].items()},
            }
        rows.append(row)
    result = {
        **meta,
        "what": f"tokens/s and peak memory per rank at world {world}: torch DDP, DeepSpeed ZeRO-3 (HF-style), dsx3d layouts",
        "world": world,
        "model": bc.model_summary(config, state),
        "workload": {**bc.workload_summary(work), "tokens_per_step": work.tokens_per_step},
        "rounds": rounds,
        "dsx3d_best": best,
        "rows": rows,
    }
    bc.emit("alternatives", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
