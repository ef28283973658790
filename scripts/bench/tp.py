"""Tensor parallelism at Megatron's communication minimum: step time against the engine before
the change and against raw DeepSpeed, activation memory and pipeline bytes with and without sequence
parallelism.

Step time (`--layouts`, default tp2, tp2 pp2, dp2 tp2 pp2): in the same ranks, from the same weights, on the
same batches, alternated step by step (A B ... B A, a barrier before each step, `common.alternate`):
  before         dsx3d with one TP entry per projection, synchronous (q, k, v, gate, up each all-reduce
                 their input gradient: the engine before shared TP entries; `TPContext.shared_entries=False`,
                 `overlap=False`), no sequence parallelism;
  shared         one entry per distinct input (q/k/v share one all-reduce, gate/up one), synchronous;
  shared+overlap the same, the collective launched asynchronously under the last weight gradient;
  sp             the default: shared, overlapped, sequence parallelism;
  deepspeed      DeepSpeed's own TP layers in a hand-written PipelineModule (`ds_tp.py`), synchronous;
  deepspeed+overlap  the same with DeepSpeed's `tp_overlap_comm` (per-linear asynchronous all-reduce).
Figures: each contender's step time over `before`'s and over `deepspeed`'s, median of per-round ratios
(wall: the slowest rank's step; CPU: seconds summed over ranks), and the largest loss difference between
contenders (same work: it must be round-off).

Memory and pipeline bytes (`--memory`, tp2 pp2, sequence parallelism off then on, each in fresh ranks): the
high-water of bytes autograd saves for backward on each rank (`memory.SavedTensorMeter`), and every
point-to-point message between the stages counted (`counting.CommCounter`): bytes per hidden-states
message, which with sequence parallelism is this rank's shard only.

    python -m scripts.bench.tp [--quick] [--rounds N] [--layouts 1,2,1 1,2,2 2,2,2] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

VARIANTS = {  # name: (sequence_parallel, shared_entries, overlap)
    "before": (False, False, False),
    "shared": (False, True, False),
    "shared+overlap": (False, True, True),
    "sp": (True, True, True),
}
DEEPSPEED = {"deepspeed": False, "deepspeed+overlap": True}


def _dsx3d(name: str, work: bc.Workload, state: dict[str, torch.Tensor], dims: tuple[int, int, int]) -> bc.Contender:
    dp, tp, pp = dims
    sp, shared, overlap = VARIANTS[name]
    contender = bc.dsx3d_contender(name, work, state, dp=dp, tp=tp, pp=pp, sequence_parallel=sp)
    context = contender.engine.module.dsx3d_builder.tp
    context.shared_entries, context.overlap = shared, overlap
    assert context.sequence_parallel == (sp and tp > 1)
    return contender


def timing_worker(
    rank: int, work: bc.Workload, state: dict[str, torch.Tensor], dims: tuple[int, int, int], rounds: int
) -> dict[str, Any]:
    from scripts.bench.ds_tp import deepspeed_tp_contender

    dp, tp, pp = dims
    contenders = [_dsx3d(name, work, state, dims) for name in VARIANTS]
    contenders += [
        deepspeed_tp_contender(name, work, state, dp, tp, pp, overlap=overlap) for name, overlap in DEEPSPEED.items()
    ]
    return bc.alternate(contenders, bc.make_batches(work, rounds + 2), rounds, warmup=2)


def memory_worker(
    rank: int, work: bc.Workload, state: dict[str, torch.Tensor], dims: tuple[int, int, int], sp: bool, steps: int
) -> dict[str, Any]:
    from scripts.bench.counting import CommCounter
    from scripts.bench.memory import SavedTensorMeter

    dp, tp, pp = dims
    contender = bc.dsx3d_contender("dsx3d", work, state, dp=dp, tp=tp, pp=pp, sequence_parallel=sp)
    engine = contender.engine
    meter = SavedTensorMeter()
    meter.exclude = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    batches = bc.make_batches(work, steps + 1)
    contender.step(batches[0])  # warm-up: shapes exchanged once
    with CommCounter() as counter, torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        for batch in batches[1:]:
            contender.step(batch)
    sends = Counter(r.nbytes for r in counter.records if r.op == "send")
    return {
        "rank": rank,
        "stage": engine.placement.pp,
        "sp": engine.module.dsx3d_builder.tp.sequence_parallel,
        "saved_high_mib": meter.high / 2**20,
        "send_bytes": {str(k): v // steps for k, v in sorted(sends.items())},
    }


def timing(work: bc.Workload, state: dict[str, torch.Tensor], dims: tuple[int, int, int], rounds: int) -> dict[str, Any]:
    dp, tp, pp = dims
    per_rank = run_ranks(timing_worker, dp * tp * pp, work, state, dims, rounds, timeout_s=3000)
    names = [*VARIANTS, *DEEPSPEED]
    wall = {n: bc.step_times(per_rank, n) for n in names}
    cpu = {n: bc.step_cpu(per_rank, n) for n in names}
    losses = per_rank[0]
    ref = losses["before"]["loss"]
    rows = {}
    for n in names:
        rows[n] = {
            "step_s": bc.rounded(statistics.median(wall[n])),
            "wall_over_before": _ratio(wall["before"], wall[n]),
            "cpu_over_before": _ratio(cpu["before"], cpu[n]),
            "wall_over_deepspeed": _ratio(wall["deepspeed"], wall[n]),
            "cpu_over_deepspeed": _ratio(cpu["deepspeed"], cpu[n]),
            "max_abs_loss_diff_vs_before": bc.rounded(
                max(abs(a - b) for a, b in zip(ref, losses[n]["loss"], strict=True)), 3
            ),
        }
    return {"layout": {"dp": dp, "tp": tp, "pp": pp}, "rounds": rounds, "contenders": rows}


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    r = bc.ratio_summary(a, b)
    return {k: bc.rounded(r[k]) for k in ("median", "ci95_low", "ci95_high")}


def memory(work: bc.Workload, state: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    dims = (1, 2, 2)
    runs = {sp: run_ranks(memory_worker, 4, work, state, dims, sp, steps, timeout_s=1200) for sp in (False, True)}
    b, s, h = work.micro_batch, work.seq_len, work.config.hidden_size
    hidden_bytes = b * s * h * 4
    out: dict[str, Any] = {"hidden_message_bytes_full": hidden_bytes, "ranks": []}
    for rank in range(4):
        off, on = runs[False][rank], runs[True][rank]
        assert on["sp"] and not off["sp"]
        out["ranks"].append(
            {
                "rank": rank,
                "stage": on["stage"],
                "saved_high_mib": {"sp_off": bc.rounded(off["saved_high_mib"]), "sp_on": bc.rounded(on["saved_high_mib"])},
                "saved_high_sp_over_off": bc.rounded(on["saved_high_mib"] / off["saved_high_mib"]),
                "send_bytes_per_step": {"sp_off": off["send_bytes"], "sp_on": on["send_bytes"]},
            }
        )
    sent_on = {int(k) for r in runs[True] for k in r["send_bytes"]}
    sent_off = {int(k) for r in runs[False] for k in r["send_bytes"]}
    out["hidden_message_bytes"] = {
        "sp_off": max(sent_off),
        "sp_on": max(sent_on),
        "ratio": bc.rounded(max(sent_on) / max(sent_off)),
        "expected_ratio": 0.5,
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds, tp2 only: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 12, quick 2)")
    parser.add_argument(
        "--layouts", nargs="*", default=None, help="dp,tp,pp triples (default 1,2,1 1,2,2 2,2,2)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory / pipeline-bytes part")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 12)
    default = ["1,2,1"] if args.quick else ["1,2,1", "1,2,2", "2,2,2"]
    layouts = [tuple(int(x) for x in t.split(",")) for t in (args.layouts or default)]
    config = bc.bench_config(args.quick)
    work = bc.Workload(config, micro_batch=2, seq_len=32 if args.quick else 128, global_batch=16)
    warm_up()
    state = bc.make_state(config)
    with bc.provenance(args.quick) as meta, bc.stdout_to_stderr():
        results = [timing(work, state, dims, rounds) for dims in layouts]  # type: ignore[arg-type]
        mem = None if args.no_memory else memory(work, state, steps=2)
    result = {
        **meta,
        "what": "step time: dsx3d before shared TP entries / shared TP entries / + overlap / + sequence parallelism / "
        "DeepSpeed's own TP layers (sync, tp_overlap_comm), same ranks, alternated; activation memory and "
        "pipeline bytes per message with and without sequence parallelism",
        "model": bc.model_summary(config, state),
        "workload": bc.workload_summary(work),
        "timing": results,
        "memory": mem,
    }
    bc.emit("tp_minimum", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
