"""The step-time cost of a checkpoint save: with the manifest against without, and synchronous against
`train.async_save`, in the same two ranks.

One dsx3d engine (dp 1 x pp 2, ZeRO-1, fp32, the 7.1M-parameter tiny Llama of scripts.bench.common: about
110 MB per tag) and one Checkpointer, whose `async_save` is switched between windows. A window is one step
(with a save, or without for "plain"), then `--after` plain steps, then `Checkpointer.wait` (an async save
commits there; a no-op otherwise); a barrier precedes every step. "bare" is the synchronous save as it was
before manifests (no checksum computed, no manifest written). Each pair runs the four windows, in the order
plain, bare, sync, async and reversed in the next pair, so machine load moves them alike. Per pair:

- the saving step's wall time (the step and the `save` call, the slowest rank's), sync / bare (the
  manifest's cost) and async / sync;
- the saving step against the plain window's first step: the cost of a save in plain steps;
- the whole window against the plain window, in plain steps: what the save costs the run, the background
  write's competition for the cores and the final wait included;
- the window's CPU seconds, summed over the ranks (all threads), async / sync.

Ratios are medians of the per-pair ratios (quartiles and a 95% interval of the median); the load average is
recorded before and after. The tags go to a temporary folder (under `--dir`: measure your own storage there);
neither kind of save fsyncs its data files, so on a local disk both write to the page cache.

    python -m scripts.bench.async_save [--pairs 10] [--after 3] [--dir PATH] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

KINDS = ("plain", "bare", "sync", "async")


def _without_manifest(checkpointer: Any) -> tuple[Any, Any]:
    """The functions the Checkpointer hashes and writes the manifest with, and stand-ins that do neither."""

    def save_plain(save: Any, path: Path) -> None:  # torch.save to the path, as DeepSpeed does
        with path.open("wb") as f:
            save(f)

    real = (checkpointer.digest, checkpointer.write_sums, checkpointer.save_hashed)
    return real, (lambda path: (0, ""), lambda *args, **kwargs: None, save_plain)


def rank_worker(rank: int, work: bc.Workload, pairs: int, after: int, out: str) -> dict[str, Any]:
    import dsx3d.checkpoint.training.checkpointer as checkpointer
    from dsx3d.checkpoint.training.checkpointer import Checkpointer
    from dsx3d.distributed import comm

    contender = bc.dsx3d_contender("dsx3d", work, bc.make_state(work.config, work.seed), dp=1, pp=2)
    recipe = bc.recipe_for(work, 1, 1, 2)
    ckpt = Checkpointer(contender.engine, Path(out), recipe, keep=2)
    real, bare = _without_manifest(checkpointer)
    batches = bc.make_batches(work, 4)
    steps = [0]

    def step() -> None:
        comm.barrier()
        contender.step(batches[steps[0] % len(batches)])
        steps[0] += 1

    def window(kind: str) -> dict[str, float]:
        ckpt.async_save = kind == "async"
        checkpointer.digest, checkpointer.write_sums, checkpointer.save_hashed = bare if kind == "bare" else real
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if kind != "plain":
            ckpt.save(steps[0], {"step": steps[0]})
        first = time.perf_counter() - t0
        for _ in range(after):
            step()
        ckpt.wait()
        return {
            "first_s": first,
            "window_s": time.perf_counter() - t0,
            "window_cpu": time.process_time() - c0,
        }

    timed: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    for r in range(pairs + 1):  # pair 0 warms up (the first save also gathers the universal-checkpoint info)
        for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
            result = window(kind)
            if r:
                timed[kind].append(result)
    tag = max(Path(out).glob("step-*"))
    return {"timed": timed, "tag_bytes": sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())}


def _series(per_rank: list[dict[str, Any]], kind: str, field: str) -> list[float]:
    """Per pair: the slowest rank's wall time (every rank left the same barrier), or CPU summed over ranks."""
    rows = zip(*(r["timed"][kind] for r in per_rank), strict=True)
    pick = sum if field == "window_cpu" else max
    return [pick(w[field] for w in row) for row in rows]


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    first = {k: _series(per_rank, k, "first_s") for k in KINDS}
    window = {k: _series(per_rank, k, "window_s") for k in KINDS}
    cpu = {k: _series(per_rank, k, "window_cpu") for k in KINDS}
    plain = first["plain"]

    def in_plain_steps(times: list[float], base: list[float]) -> float:
        return statistics.median((t - b) / p for t, b, p in zip(times, base, plain, strict=True))

    def summary(a: list[float], b: list[float]) -> dict[str, float]:
        return {k: bc.rounded(v) for k, v in bc.ratio_summary(a, b).items()}

    return {
        "tag_bytes": per_rank[0]["tag_bytes"],
        "median_s": {
            k: {
                "saving_step": bc.rounded(statistics.median(first[k])),
                "window": bc.rounded(statistics.median(window[k])),
            }
            for k in KINDS
        },
        "saving_step_async_over_sync": summary(first["sync"], first["async"]),
        "saving_step_manifest_over_bare": summary(first["bare"], first["sync"]),
        "saving_step_over_plain_step": {k: summary(plain, first[k]) for k in KINDS[1:]},
        "window_cost_in_plain_steps": {
            k: bc.rounded(in_plain_steps(window[k], window["plain"])) for k in KINDS[1:]
        },
        "window_cpu_async_over_sync": summary(cpu["sync"], cpu["async"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pairs", type=int, default=10, help="rounds of the four windows after one warm-up round"
    )
    parser.add_argument(
        "--after", type=int, default=3, help="plain steps after the saving step in each window"
    )
    parser.add_argument("--quick", action="store_true", help="0.2M-parameter model, short rows: a smoke run")
    parser.add_argument(
        "--dir", default=None, help="where the tags are written (a temporary folder under it)"
    )
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    work = bc.Workload(
        bc.bench_config(args.quick), micro_batch=2, seq_len=32 if args.quick else 128, global_batch=8
    )
    warm_up()
    with (
        bc.provenance(args.quick) as meta,
        tempfile.TemporaryDirectory(prefix="dsx3d-bench-async-", dir=args.dir) as out,
    ):
        per_rank = run_ranks(rank_worker, 2, work, args.pairs, args.after, out, timeout_s=1800)
    result = {
        **meta,
        "what": "step time of a checkpoint save, with vs without the manifest and synchronous vs train.async_save, windows alternated in the same ranks",
        "layout": {"dp": 1, "tp": 1, "pp": 2},
        "workload": bc.workload_summary(work),
        "pairs": args.pairs,
        "after": args.after,
        **summarize(per_rank),
    }
    bc.emit("async_save" if not args.quick else "async_save_quick", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
