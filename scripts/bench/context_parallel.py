"""Context parallelism (`parallel.cp`, Ulysses) measured: activation memory, the longest sequence within a
memory budget, step time with its all-to-all share, and the estimator against the measured peak.

Every figure is a ratio against a baseline measured in the same run, fp32, ZeRO-0, pp 1, tp 1, a Llama with
GQA, ranks forked by dsx3d.verify.harness (one thread each), large allocations mapped on their own
(`mallopt(M_MMAP_THRESHOLD, 64 KiB)`) so the resident set follows the live tensors.

1. memory: per-rank peak resident set over one training step, above the resident set before it (a warm-up
   step first: Adam's moments and the groups exist), cp 2 against cp 1 at the same seq_len; runs alternate
   (cp 1, cp 2, cp 2, cp 1, ...), each in fresh forked ranks.
2. budget: the longest seq_len (doubling from `--budget-start`) whose first training step keeps every rank's
   resident set within `--budget-mib` above its resident set at the fork (what the rank adds: runtime,
   states, activations), at cp 1, 2 and 4, each try in a fresh process group. A watchdog thread ends a rank
   as soon as its resident set passes the budget, so a failing try costs little.
3. time: dp 2 x cp 1 against dp 1 x cp 2 in the same 2 ranks and the same global tokens (2 sequences per
   step), both engines built in one process group and stepped alternately (A B, B A, ...; a barrier before
   each step). `deepspeed.comm.all_to_all_single` (what DeepSpeed's Ulysses exchange calls, forward and
   backward) is wrapped with a timer in the ranks: its wall seconds per step are the all-to-all share, which
   includes waiting for the peer to arrive.
4. estimator: `dsx3d.estimate` on the shapes of 1. (cp 1 and cp 2; sdpa as unfused and as flash attention)
   against the measured activation peak.

    python -m scripts.bench.context_parallel [--quick] [--seq-len 2048] [--rounds 2] [--pairs 12] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Iterator

import torch

from dsx3d.verify.harness import RankFailure, run_ranks, warm_up
from scripts.bench import common as bc
from scripts.bench.cp_estimate import estimator_rows

MiB = 1024**2
OVER_BUDGET = 17  # a rank's exit code when its resident set passed the budget

# (hidden, layers, heads, kv heads, intermediate, vocab)
MODEL = (256, 4, 8, 4, 688, 2048)
QUICK = (64, 2, 4, 2, 172, 512)
BUDGET_MODEL = (64, 2, 4, 4, 172, 512)


def model_config(dims: tuple[int, ...], seq_len: int) -> dict[str, object]:
    hidden, layers, heads, kv, inter, vocab = dims
    return {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
        "max_position_embeddings": seq_len, "tie_word_embeddings": False,
    }


def recipe(dims: tuple[int, ...], seq_len: int, cp: int, dp: int = 1, micro_batch: int = 1) -> object:
    from dsx3d.recipe.schema import recipe_from_dict

    return recipe_from_dict(
        {
            "model": {"config": model_config(dims, seq_len)},
            "parallel": {"dp": dp, "cp": cp, "tp": 1, "pp": 1},
            "cluster": {"nodes": 1, "gpus_per_node": dp * cp},
            "train": {
                "micro_batch_size": micro_batch, "gradient_accumulation_steps": 1, "seq_len": seq_len,
                "dtype": "fp32",
            },
            "zero": {"stage": 0},
        }
    )


def _tokens(vocab: int, rows: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(seed))


def _mmap_large() -> None:
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


# -- 1. activation memory at one seq_len --------------------------------------------------------------------


def memory_worker(rank: int, dims: tuple[int, ...], seq_len: int, cp: int) -> dict[str, object]:
    from dsx3d.engine.builder import build_engine

    _mmap_large()
    engine = build_engine(recipe(dims, seq_len, cp))
    ids = _tokens(dims[-1], 1, seq_len)
    engine.train_step(iter([(ids, ids)]))
    if not bc.reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs is not writable: the peak RSS cannot be reset")
    before = bc.proc_status_kb("VmRSS")
    loss = engine.train_step(iter([(ids, ids)]))
    peak = bc.proc_status_kb("VmHWM")
    return {"rank": rank, "step_peak_mib": (peak - before) / 1024, "rss_before_mib": before / 1024, "loss": loss}


def measure_memory(dims: tuple[int, ...], seq_len: int, rounds: int) -> dict[str, object]:
    runs: dict[str, list[list[dict[str, object]]]] = {"1": [], "2": []}
    for i in range(rounds):
        for cp in (1, 2) if i % 2 == 0 else (2, 1):
            runs[str(cp)].append(run_ranks(memory_worker, cp, dims, seq_len, cp, timeout_s=900))
    # per run, the fullest rank (the CP ranks of one run hold the same amount up to a few MiB)
    peaks = {cp: [max(r["step_peak_mib"] for r in ranks) for ranks in v] for cp, v in runs.items()}
    med = {cp: statistics.median(v) for cp, v in peaks.items()}
    return {
        "seq_len": seq_len,
        "rounds": rounds,
        "step_peak_mib": {cp: [[bc.rounded(r["step_peak_mib"]) for r in ranks] for ranks in v] for cp, v in runs.items()},
        "median_step_peak_mib": {cp: bc.rounded(x) for cp, x in med.items()},
        "ratio_cp2_over_cp1": bc.rounded(med["2"] / med["1"]),
        "losses": {cp: [bc.rounded(ranks[0]["loss"], 7) for ranks in v] for cp, v in runs.items()},
    }


# -- 2. the longest seq_len within a budget --------------------------------------------------------------------


def _watchdog(limit_kb: int) -> None:
    def watch() -> None:
        while True:
            if bc.proc_status_kb("VmRSS") > limit_kb:
                os._exit(OVER_BUDGET)
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()


def budget_worker(rank: int, dims: tuple[int, ...], seq_len: int, cp: int, budget_mib: float) -> dict[str, object]:
    from dsx3d.engine.builder import build_engine

    _mmap_large()
    bc.reset_peak_rss()
    at_fork = bc.proc_status_kb("VmRSS")
    _watchdog(at_fork + int(budget_mib * 1024))
    engine = build_engine(recipe(dims, seq_len, cp))
    ids = _tokens(dims[-1], 1, seq_len)
    loss = engine.train_step(iter([(ids, ids)]))
    return {"peak_over_fork_mib": (bc.proc_status_kb("VmHWM") - at_fork) / 1024, "loss": loss}


def _fits(dims: tuple[int, ...], seq_len: int, cp: int, budget_mib: float) -> tuple[bool, float | None]:
    try:
        ranks = run_ranks(budget_worker, cp, dims, seq_len, cp, budget_mib, timeout_s=600)
    except RankFailure as e:
        if f"{OVER_BUDGET}" in str(e).splitlines()[0]:
            return False, None
        raise
    peak = max(r["peak_over_fork_mib"] for r in ranks)
    return peak <= budget_mib, peak


def longest_within(dims: tuple[int, ...], cps: list[int], budget_mib: float, start: int, cap: int) -> dict[str, object]:
    found: dict[str, dict[str, object]] = {}
    s = start
    for cp in cps:  # a larger cp never fits less: its search starts where the previous one's last fit was
        tries: list[dict[str, object]] = []
        best = None
        while s <= cap:
            ok, peak = _fits(dims, s, cp, budget_mib)
            tries.append({"seq_len": s, "fits": ok, "peak_over_fork_mib": None if peak is None else bc.rounded(peak)})
            if not ok:
                break
            best, s = s, 2 * s
        found[str(cp)] = {"longest_seq_len": best, "tries": tries, "capped": s > cap}
        s = best or start
    base = found[str(cps[0])]["longest_seq_len"] or 0
    for v in found.values():
        v["over_cp1"] = bc.rounded(v["longest_seq_len"] / base) if base and v["longest_seq_len"] else None
    return {"budget_mib": budget_mib, "start": start, "cap": cap, "by_cp": found}


# -- 3. step time, dp 2 against cp 2, with the all-to-all share ------------------------------------------------

_A2A: dict[str, float] = {"seconds": 0.0, "calls": 0, "bytes": 0}


@contextlib.contextmanager
def _timed_all_to_all() -> Iterator[None]:
    """Wrap deepspeed.comm.all_to_all_single (resolved at call time by DeepSpeed's Ulysses exchange, forward
    and backward) with a timer in this process, so every rank forked inside inherits it; restored after."""
    import deepspeed.comm as ds_comm

    inner = ds_comm.all_to_all_single

    def timed(output: torch.Tensor, tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        out = inner(output, tensor, *args, **kwargs)
        _A2A["seconds"] += time.perf_counter() - t0
        _A2A["calls"] += 1
        _A2A["bytes"] += tensor.numel() * tensor.element_size()
        return out

    ds_comm.all_to_all_single = timed
    try:
        yield
    finally:
        ds_comm.all_to_all_single = inner


def time_worker(rank: int, dims: tuple[int, ...], seq_len: int, pairs: int, warmup: int) -> dict[str, object]:
    from dsx3d.distributed import comm
    from dsx3d.engine.builder import build_engine

    batch = _tokens(dims[-1], 2, seq_len, seed=1)
    engines = {
        "dp2": build_engine(recipe(dims, seq_len, cp=1, dp=2)),
        "cp2": build_engine(recipe(dims, seq_len, cp=2, dp=1, micro_batch=2)),
    }
    micro = {"dp2": batch[rank : rank + 1], "cp2": batch}  # dp2: one sequence per rank; cp2: both, sliced
    out: dict[str, dict[str, list[float]]] = {k: {"seconds": [], "cpu": [], "a2a_s": [], "a2a_calls": [], "a2a_bytes": [], "loss": []} for k in engines}
    for r in range(warmup + pairs):
        for name in ("dp2", "cp2") if r % 2 == 0 else ("cp2", "dp2"):
            comm.barrier()
            _A2A.update(seconds=0.0, calls=0, bytes=0)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = engines[name].train_step(iter([(micro[name], micro[name])]))
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            if r >= warmup:
                row = out[name]
                row["seconds"].append(seconds)
                row["cpu"].append(cpu)
                row["a2a_s"].append(_A2A["seconds"])
                row["a2a_calls"].append(_A2A["calls"])
                row["a2a_bytes"].append(_A2A["bytes"])
                row["loss"].append(loss)
    return out


def _spread(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": bc.rounded(statistics.median(xs)), "q1": bc.rounded(q[0]), "q3": bc.rounded(q[2]),
            "min": bc.rounded(min(xs)), "max": bc.rounded(max(xs))}


def measure_time(dims: tuple[int, ...], seq_len: int, pairs: int) -> dict[str, object]:
    per_rank = run_ranks(time_worker, 2, dims, seq_len, pairs, 1, timeout_s=1800)
    wall = {k: [max(ts) for ts in zip(*(r[k]["seconds"] for r in per_rank), strict=True)] for k in ("dp2", "cp2")}
    cpu = {k: [sum(ts) for ts in zip(*(r[k]["cpu"] for r in per_rank), strict=True)] for k in ("dp2", "cp2")}
    share = [a / s for r in per_rank for a, s in zip(r["cp2"]["a2a_s"], r["cp2"]["seconds"], strict=True)]
    ratio = bc.ratio_summary(wall["dp2"], wall["cp2"])
    cpu_ratio = bc.ratio_summary(cpu["dp2"], cpu["cp2"])
    inside = ratio["ci95_low"] <= 1.0 <= ratio["ci95_high"]
    return {
        "seq_len": seq_len,
        "pairs": pairs,
        "tokens_per_step": 2 * seq_len,
        "step_s": {k: _spread(v) for k, v in wall.items()},
        "cpu_s": {k: _spread(v) for k, v in cpu.items()},
        "ratio_cp2_over_dp2": {k: bc.rounded(v) for k, v in ratio.items()},
        "cpu_ratio_cp2_over_dp2": {k: bc.rounded(v) for k, v in cpu_ratio.items()},
        "difference_inside_noise": inside,
        "a2a_share_of_step": _spread(share),
        "a2a_s_per_step": _spread([a for r in per_rank for a in r["cp2"]["a2a_s"]]),
        "a2a_calls_per_step": per_rank[0]["cp2"]["a2a_calls"][0],
        "a2a_bytes_sent_per_step": per_rank[0]["cp2"]["a2a_bytes"][0],
        "dp2_a2a_calls": per_rank[0]["dp2"]["a2a_calls"][0],
        "max_abs_loss_diff": bc.rounded(max(abs(a - b) for a, b in zip(per_rank[0]["dp2"]["loss"], per_rank[0]["cp2"]["loss"], strict=True)), 3),
    }


# -- the run ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not a measurement")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence for 1, 3 and 4")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each cp for the memory ratio")
    parser.add_argument("--pairs", type=int, default=12, help="timed rounds (each steps both layouts)")
    parser.add_argument("--budget-mib", type=float, default=128.0, help="per-rank budget above the RSS at the fork")
    parser.add_argument("--budget-start", type=int, default=1024)
    parser.add_argument("--budget-cap", type=int, default=65536)
    parser.add_argument("--budget-cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    dims = QUICK if args.quick else MODEL
    seq = 512 if args.quick else args.seq_len
    warm_up()
    with bc.provenance(args.quick) as meta, _timed_all_to_all():
        t0 = time.perf_counter()
        memory = measure_memory(dims, seq, args.rounds)
        budget = longest_within(
            QUICK if args.quick else BUDGET_MODEL, args.budget_cp, args.budget_mib, args.budget_start, args.budget_cap
        )
        timing = measure_time(dims, seq, args.pairs)
        parts_s = bc.rounded(time.perf_counter() - t0)
    hidden, layers, heads, kv, inter, vocab = dims
    result = {
        **meta,
        "what": "context parallelism (Ulysses): activation memory cp 2 / cp 1, longest seq_len within a per-rank "
        "budget at each cp, step time cp 2 / dp 2 with the all-to-all share, the estimator against the measured peak",
        "model": {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv, "intermediate": inter, "vocab": vocab},
        "budget_model": dict(zip(("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"), QUICK if args.quick else BUDGET_MODEL, strict=True)),
        "memory": memory,
        "budget": budget,
        "time": timing,
        "estimator": estimator_rows(model_config(dims, seq), seq, memory["median_step_peak_mib"]),
        "parts_s": parts_s,
    }
    bc.emit("context_parallel" if not args.quick else "context_parallel_quick", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
