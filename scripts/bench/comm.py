"""Communication per step by group type (TP, EP, PP, DP), counted, against the estimator's analytic volumes.

Every call this process makes into torch.distributed is counted by `bench.counting` (a hook on the
ProcessGroup methods all collectives and p2p calls end in, DeepSpeed's included) with its group's ranks and
its buffer size, during `--steps` optimizer steps after one warm-up step (the first step also exchanges
tensor shapes once). A call is attributed to a group type by its ranks, from the layout: the TP (slice)
groups, the DP groups (and, with expert parallelism, the expert-data-parallel groups over which expert
gradients are reduced), all-to-alls over the EP groups (EP), send/recv between adjacent stages of a pipeline
(PP), all-reduces over a (first, last) stage pair (tied embedding); broadcasts over a pipe group (the loss), the model-parallel group
(pp x tp: gradient-norm scalars) and the world are reported separately. Bytes are those one rank sends,
ring-counted (`CommRecord.sent_bytes`), the estimator's unit. TP and PP must agree exactly with
`dsx3d.estimate` per stage; DP is compared too (DeepSpeed also all-reduces two 4-byte scalars over DP, the
gradient norm's partial sum and the loss, which the estimator leaves out). EP bytes depend on where the
router sends the tokens: the estimator assumes routes spread evenly, so EP is compared, not required equal
(counted: the rows each all-to-all sends to other ranks, and the per-expert counts exchanged before them).

    python -m scripts.bench.comm [--quick] [--dp 2 --tp 2 --pp 2] [--ep 2] [--checkpointing] [--family qwen3] [--no-write]
    python -m scripts.bench.comm --sweep     # every family with plans, quick (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from typing import Any

import torch

from dsx3d.distributed.topology import pipeline_topology
from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc


def classify(record: Any, layout: Any) -> str:
    """The group type of a CommRecord under `layout` (see the module docstring)."""
    ranks = set(record.ranks)
    if record.op in ("send", "recv"):
        same_pipe = any(ranks <= set(g) for g in layout.pp_groups())
        return "pp" if same_pipe else "other"
    if len(ranks) == 1:
        return "other"
    if record.op == "all_to_all" and any(ranks == set(g) for g in layout.ep_groups()):
        return "ep"
    for kind, groups in (("tp", layout.tp_groups()), ("dp", layout.dp_groups() + layout.edp_groups())):
        if any(ranks == set(g) for g in groups):
            return kind
    # the tied embedding/head gradient is all-reduced over (first, last) stage pairs, which are whole pipe
    # groups when pp = 2; the loss is broadcast over the pipe group
    if record.op == "all_reduce" and any(ranks == set(g) for g in layout.tied_groups()):
        return "tied"
    if any(ranks == set(g) for g in layout.pp_groups()):
        return "pipe_collective"
    model_parallel = [set(pipeline_topology(layout).filter_match(data=d)) for d in range(layout.dp)]
    if ranks in model_parallel:
        return "model_parallel"
    if len(ranks) == layout.world_size:
        return "world"
    return "other"


def worker(
    rank: int,
    work: bc.Workload,
    state: dict[str, torch.Tensor],
    dims: tuple[int, ...],
    steps: int,
    ckpt: bool,
) -> dict[str, Any]:
    from scripts.bench.counting import CommCounter

    dp, tp, pp, ep = (*dims, 1)[:4]
    contender = bc.dsx3d_contender(
        "dsx3d", work, state, dp=dp, tp=tp, pp=pp, ep=ep, activation_checkpointing=ckpt
    )
    engine = contender.engine
    batches = bc.make_batches(work, steps + 1)
    with CommCounter() as counter:
        contender.step(batches[0])  # warm-up: DeepSpeed sends tensor shapes once, on the first step
        counter.records.clear()
        for i in range(steps):
            contender.step(batches[1 + i])
        records = list(counter.records)
    per_kind: dict[str, dict[str, float]] = defaultdict(
        lambda: {"sent_bytes": 0.0, "buffer_bytes": 0, "calls": 0, "latency_steps": 0.0}
    )
    ops: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        kind = classify(r, engine.layout)
        per_kind[kind]["sent_bytes"] += r.sent_bytes() / steps
        per_kind[kind]["buffer_bytes"] += r.nbytes // steps
        per_kind[kind]["calls"] += 1
        per_kind[kind]["latency_steps"] += ring_steps(r.op, r.group_size) / steps
        ops[kind][r.op] += 1
    for kind, d in per_kind.items():
        d["calls"] = d["calls"] // steps
        d["ops"] = {op: n // steps for op, n in ops[kind].items()}  # type: ignore[assignment]
    layers = sum(1 for m in engine.module.modules() if type(m).__name__ == "DecoderLayerPipe")
    return {"rank": rank, "stage": engine.placement.pp, "layers": layers, "per_kind": dict(per_kind)}


def ring_steps(op: str, group: int) -> float:
    """Latency steps of one call as `dsx3d.estimate.kernels` counts them: an all-reduce 2(g-1), an all-gather
    or reduce-scatter g-1."""
    return {"all_reduce": 2 * (group - 1), "all_gather": group - 1, "reduce_scatter": group - 1}.get(op, 0)


def analytic(work: bc.Workload, dims: tuple[int, ...], stage_layers: list[int], ckpt: bool) -> Any:
    return bc.estimate_for(work, dims, stage_layers, activation_checkpointing=ckpt)


def analytic_tp_steps(work: bc.Workload, dims: tuple[int, ...], stage_layers: list[int], ckpt: bool) -> list[float]:
    """TP latency steps per optimizer step of each stage's rank (`timing.tp_latency_steps_per_micro_batch`)."""
    from dsx3d.estimate import Setup, shape_from_hf_config, timing
    from dsx3d.estimate.inputs import sequence_parallel

    dp, tp, pp = dims[:3]
    shape = shape_from_hf_config(work.config)
    sp = sequence_parallel(shape, Setup(tp=tp, sequence_parallel=True))
    m = work.micro_batches(dp)
    return [
        m * timing.tp_latency_steps_per_micro_batch(
            shape, layers=n, tp=tp, first=i == 0, last=i == pp - 1, checkpointing=ckpt, sequence_parallel=sp
        )
        for i, n in enumerate(stage_layers)
    ]


def run(
    quick: bool,
    dims: tuple[int, ...] = (2, 2, 2),
    steps: int | None = None,
    ckpt: bool = False,
    family: str | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure and compare; returns the result (also what the smoke test asserts on). `family`: a
    model_type whose `dsx3d.models.known_families.tiny_config` replaces the benchmark's Llama (other TP plans, tying)."""
    from dsx3d.models.known_families import tiny_config

    steps = steps or (1 if quick else 3)
    dp, tp, pp, ep = (*dims, 1)[:4]
    config = bc.bench_config(quick) if family is None else tiny_config(family, **(config_overrides or {}))
    work = bc.Workload(config, micro_batch=2, seq_len=16 if quick else 128, global_batch=2 * dp * 2 * pp)
    warm_up()
    state = bc.make_state(work.config)
    with bc.provenance(quick) as meta:
        per_rank = run_ranks(worker, dp * tp * pp, work, state, dims, steps, ckpt, timeout_s=600)
    stage_layers = [next(r["layers"] for r in per_rank if r["stage"] == s) for s in range(pp)]
    est = analytic(work, dims, stage_layers, ckpt)
    tp_steps = analytic_tp_steps(work, dims, stage_layers, ckpt)
    rows = []
    for r in per_rank:
        predicted = est.stages[r["stage"]].comm_bytes
        row: dict[str, Any] = {"rank": r["rank"], "stage": r["stage"]}
        for kind in ("tp", "ep", "pp", "dp", "tied"):
            measured = r["per_kind"].get(kind, {}).get("sent_bytes", 0.0)
            row[kind] = {
                "measured": measured,
                "analytic": predicted.get(kind, 0.0),
                "equal": math.isclose(measured, predicted.get(kind, 0.0), rel_tol=1e-9, abs_tol=1e-6),
            }
        row["tp_latency_steps"] = {
            "measured": r["per_kind"].get("tp", {}).get("latency_steps", 0.0),
            "analytic": tp_steps[r["stage"]],
        }
        row["other"] = {k: v for k, v in r["per_kind"].items() if k not in ("tp", "ep", "pp", "dp", "tied")}
        row["ops"] = {k: v["ops"] for k, v in r["per_kind"].items()}
        rows.append(row)
    exact = {kind: all(row[kind]["equal"] for row in rows) for kind in ("tp", "pp", "dp", "tied")}
    ep_ratio = [row["ep"]["measured"] / row["ep"]["analytic"] for row in rows if row["ep"]["analytic"]]
    dp_ratio = [row["dp"]["measured"] / row["dp"]["analytic"] for row in rows if row["dp"]["analytic"]]
    # scalars the model leaves out: ZeRO-1's gradient-norm partial sum (4 bytes, every stage) and the loss
    # (4 bytes, last stage), both all-reduced over DP
    dp_excess = [row["dp"]["measured"] - row["dp"]["analytic"] for row in rows]
    return {
        **meta,
        "what": "bytes one rank sends per optimizer step by group type: counted vs dsx3d.estimate",
        "model_type": config.model_type,
        "tied": bool(getattr(config, "tie_word_embeddings", False)),
        "layout": {
            "dp": dp,
            "tp": tp,
            "pp": pp,
            "ep": ep,
            "stage_layers": stage_layers,
            "activation_checkpointing": ckpt,
        },
        "workload": {
            "micro_batch": work.micro_batch,
            "grad_accum": work.micro_batches(dp),
            "seq_len": work.seq_len,
            "dtype": work.dtype,
            "hidden": work.config.hidden_size,
            "vocab": work.config.vocab_size,
        },
        "steps_counted": steps,
        "exact": exact,
        "dp_measured_over_analytic": [bc.rounded(x, 6) for x in dp_ratio],
        "dp_excess_bytes": [bc.rounded(x, 6) for x in dp_excess],
        "ep_measured_over_analytic": [bc.rounded(x, 4) for x in ep_ratio],
        "ranks": rows,
    }


def sweep() -> dict[str, Any]:
    """Every family with TP and PP plans (`dsx3d.models.known_families.families_with_plans`), quick, dp1 tp2 pp2: which
    agree exactly (TP, PP, tied), which differ (by how much), which dsx3d refuses or cannot build."""
    from dsx3d.models.known_families import families_with_plans

    families: dict[str, Any] = {}
    for family in families_with_plans():
        try:
            r = run(True, (1, 2, 2), family=family)
        except Exception as err:  # refused by the checker, or a tiny config transformers cannot build
            families[family] = {"error": (str(err).strip().splitlines() or [repr(err)])[-1][:300]}
            continue
        worst = {
            kind: max(
                row[kind]["measured"] / row[kind]["analytic"] for row in r["ranks"] if row[kind]["analytic"]
            )
            for kind in ("tp", "pp")
        }
        families[family] = {
            "exact": r["exact"],
            "measured_over_analytic_max": {k: bc.rounded(v, 6) for k, v in worst.items()},
        }
    return families


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one counted step: a smoke run")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (an MoE --family)")
    parser.add_argument("--steps", type=int, default=None, help="counted steps (default 3, quick 1)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    parser.add_argument(
        "--family",
        default=None,
        help="a tiny config of this model_type instead of the Llama (qwen3, gemma2, ...)",
    )
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    parser.add_argument(
        "--sweep", action="store_true", help="every family with plans, quick, dp1 tp2 pp2 (minutes)"
    )
    args = parser.parse_args(argv)
    if args.sweep:
        with bc.provenance(True) as meta, bc.stdout_to_stderr():
            families = sweep()
        swept = {
            **meta,
            "what": "TP/PP/tied bytes counted vs dsx3d.estimate for every family with plans",
            "families": families,
        }
        bc.emit("communication_sweep", swept, write=not args.no_write)
        return swept
    result = run(args.quick, (args.dp, args.tp, args.pp, args.ep), args.steps, args.checkpointing, args.family)
    key = (
        "communication"
        + (f"_{args.family}" if args.family else "")
        + (f"_ep{args.ep}" if args.ep > 1 else "")
        + ("_checkpointing" if args.checkpointing else "")
    )
    bc.emit(key, result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
