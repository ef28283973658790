"""The stage split by measured cost against the parameter split and the FLOP split, on a model whose vocabulary is
larger than its hidden size squared: each stage's measured time per micro-batch in the engine.

1. `dsx3d.pipeline.measured_split.item_seconds` times the embedding, one decoder layer and the final norm + head +
   loss (forward + backward of one micro-batch, thread CPU time) and `measured_stage_layers` splits on them.
2. The parameter split: the same min-max partition over parameter counts (DeepSpeed's `partition_method:
   parameters` balances those); the FLOP split: dsx3d's default (`dsx3d.pipeline.split.stage_layers_for`).
3. Each split runs in dsx3d's engine (pp = p, fp32, 1F1B) in the same forked ranks, alternated; every stage's F
   and B busy time (`StageClock`, CPU time) per micro-batch, median over the timed steps. Reported: per split the
   stage times, max/min over stages, and the slowest stage's time over the measured split's.

    python -m scripts.bench.cost_split [--vocab 16384] [--hidden 64] [--layers 24] [--pp 2] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from dsx3d.distributed import comm
from dsx3d.pipeline.measured_split import item_seconds, measured_stage_layers
from dsx3d.pipeline.split import balanced_bounds, decoder_units, layout_string, stage_layers_for
from dsx3d.pipeline.stage_clock import StageClock, part_costs
from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc


def parameter_split(state: dict[str, torch.Tensor], layers: int, pp: int) -> list[int]:
    def count(prefix: str) -> int:
        return sum(t.numel() for k, t in state.items() if k.startswith(prefix))

    items = [count("model.embed_tokens."), *[count(f"model.layers.{i}.") for i in range(layers)], count("model.norm."), count("lm_head.")]
    bounds = balanced_bounds(decoder_units([float(n) for n in items]), pp)
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def worker(rank: int, work: bc.Workload, state: dict[str, torch.Tensor], splits: dict[str, list[int]], rounds: int) -> dict[str, Any]:
    pp = comm.get_world_size()
    contenders, clocks = [], {}
    for name, split in splits.items():
        c = bc.dsx3d_contender(name, work, state, dp=1, pp=pp, stage_layers=split)
        clocks[name] = StageClock(c.engine.ds_engine)
        contenders.append(c)
    batches = bc.make_batches(work, 2)
    per: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(1 + rounds):
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            clocks[c.name].take()
            comm.barrier()
            c.step(batches[r % 2])
            parts = part_costs(clocks[c.name].take())
            if r:
                per[c.name].append((parts["F"] or 0.0) + (parts["B"] or 0.0))
    return {"stage": rank, "seconds": {k: statistics.median(v) for k, v in per.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    config = bc.bench_config(
        True, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=176 * args.hidden // 64,
        num_hidden_layers=args.layers,
    )
    seq, mb = 128, 2
    work = bc.Workload(config, micro_batch=mb, seq_len=seq, global_batch=mb * 2 * args.pp)
    warm_up()
    state = bc.make_state(config)
    with bc.provenance(False) as meta:
        seconds = item_seconds(config, mb, seq, reps=5)
        splits = {
            "measured": measured_stage_layers(seconds, args.layers, args.pp),
            "parameters": parameter_split(state, args.layers, args.pp),
            "flops": stage_layers_for(config, args.pp, seq, None),
        }
        per_rank = run_ranks(worker, args.pp, work, state, splits, args.rounds, timeout_s=3000)
    rows = {}
    for name, split in splits.items():
        times = [r["seconds"][name] for r in sorted(per_rank, key=lambda r: r["stage"])]
        rows[name] = {"stage_layers": split, "layout": layout_string(split), "stage_seconds": times,
                      "max_over_min": max(times) / min(times), "slowest": max(times)}
    for row in rows.values():
        row["slowest_over_measured"] = row["slowest"] / rows["measured"]["slowest"]
    result = {**meta, "what": "measured stage times (F + B per micro-batch, CPU s) of three splits",
              "model": bc.model_summary(config, state), "item_seconds": seconds, "rounds": args.rounds, "splits": rows}
    bc.emit("cost_split", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
