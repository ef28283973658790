"""Non-padding tokens per second of packed SFT rows (data.packing) against one padded example per row.

A synthetic chat set: examples whose lengths are drawn uniformly between 10% and 100% of seq_len, the loss on
a suffix (the answer). Two dsx3d engines with the same weights and layout run in the same forked ranks,
alternated step by step (scripts.bench.common.alternate): one reads one right-padded example per row
(dsx3d.data.stream with each example's length), the other the same examples best-fit packed with
position_ids restarting per example (dsx3d.data.sft_packing). Both steps have the same shape
(micro x seq_len x grad_accum x dp), so the packed step does the same tensor work on more real tokens, plus
the per-document attention mask. Per round: real tokens / step seconds of each; the result is the median of
the per-round ratios packed / padded, with the padding fraction of each side and the load average.

    python -m scripts.bench.packing [--quick] [--layout 1,1,2] [--rounds 8] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np
import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

IGNORE_INDEX = -100


def chat_set(num: int, seq_len: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, labels, lengths): padded examples of uniform length in [seq_len/10, seq_len], loss on a suffix."""
    g = np.random.default_rng(seed)
    lengths = g.integers(max(2, seq_len // 10), seq_len + 1, size=num).astype(np.int32)
    ids = np.zeros((num, seq_len), dtype=np.int64)
    labels = np.full((num, seq_len), IGNORE_INDEX, dtype=np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = g.integers(1, vocab, size=n)
        answer = int(g.integers(1, n))
        labels[i, n - answer : n] = ids[i, n - answer : n]
    return ids, labels, lengths


def _contender(name: str, work: bc.Workload, state: dict[str, torch.Tensor], layout: tuple[int, int, int], rows: dict[str, Any]) -> tuple[bc.Contender, list[int]]:
    from dsx3d.data.stream import MicroBatchStream
    from dsx3d.engine.builder import build_engine
    from dsx3d.models.weights import StateDictSource

    dp, tp, pp = layout
    engine = build_engine(bc.recipe_for(work, dp, tp, pp), hf_config=work.config, source=StateDictSource(state))
    m = work.micro_batches(dp)
    stream = MicroBatchStream(rows["ids"], work.micro_batch, m, dp, engine.placement.dp, seed=1, labels=rows["labels"],
                              positions=rows.get("positions"), lengths=rows["lengths"])
    real: list[int] = []

    def step(_: Any) -> float:
        at = stream.step
        real.append(round((1 - stream.padding_fraction(at)) * work.tokens_per_step))
        return engine.train_step(iter([next(stream) for _ in range(m)]))

    return bc.Contender(name, step, engine=engine, loss_is_global=True), real


def rank_worker(rank: int, work: bc.Workload, layout: tuple[int, int, int], data: dict[str, dict[str, Any]], rounds: int) -> dict[str, Any]:
    state = bc.make_state(work.config, work.seed)
    padded, real_padded = _contender("padded", work, state, layout, data["padded"])
    packed, real_packed = _contender("packed", work, state, layout, data["packed"])
    out: dict[str, Any] = dict(bc.alternate([padded, packed], [None], rounds))
    warm = len(real_padded) - rounds
    out["real_tokens"] = {"padded": real_padded[warm:], "packed": real_packed[warm:]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from dsx3d.data.sft_packing import pack_examples

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.2M-parameter model, short rows: a smoke run")
    parser.add_argument("--layout", default="1,1,2", help="dp,tp,pp (default 1,1,2)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    layout = tuple(int(x) for x in args.layout.split(","))
    assert len(layout) == 3, "--layout dp,tp,pp"
    seq_len = 32 if args.quick else 256
    work = bc.Workload(bc.bench_config(args.quick), micro_batch=2, seq_len=seq_len, global_batch=4 * layout[0])
    ids, labels, lengths = chat_set(work.global_batch * (args.rounds + 2) * 2, seq_len, work.config.vocab_size)
    labels[:, 0] = IGNORE_INDEX
    packed = pack_examples(ids, labels, lengths, 0)
    data = {
        "padded": {"ids": ids, "labels": labels, "lengths": lengths},
        "packed": {"ids": packed.input_ids, "labels": packed.labels, "positions": packed.positions, "lengths": packed.lengths},
    }
    world = layout[0] * layout[1] * layout[2]
    warm_up()
    with bc.provenance(args.quick) as meta:
        per_rank = run_ranks(rank_worker, world, work, layout, data, args.rounds, timeout_s=900)
    times = {k: bc.step_times(per_rank, k) for k in ("padded", "packed")}
    real = per_rank[0]["real_tokens"]
    per_token = {k: [t / n for t, n in zip(times[k], real[k], strict=True)] for k in times}
    pad = {k: 1 - statistics.fmean(real[k]) / work.tokens_per_step for k in times}
    result = {
        **meta,
        "what": "non-padding tokens per second, packed SFT rows (data.packing) vs one padded example per row, "
        "alternated steps in the same ranks, same shapes and weights",
        "layout": dict(zip(("dp", "tp", "pp"), layout, strict=True)),
        "workload": {**bc.workload_summary(work), "lengths": "uniform in [seq_len/10, seq_len]"},
        "rounds": args.rounds,
        "padding_fraction": {k: bc.rounded(v) for k, v in pad.items()},
        "real_tokens_per_s": {k: bc.rounded(statistics.fmean(real[k]) / statistics.median(times[k])) for k in times},
        # ratio_summary gives B / A of its arguments: seconds per real token, padded over packed = the speed-up
        "packed_over_padded": {k: bc.rounded(v) for k, v in bc.ratio_summary(per_token["packed"], per_token["padded"]).items()},
    }
    bc.emit("packing" if not args.quick else "packing_quick", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
