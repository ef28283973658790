"""The cost of checkpoint manifests: a save with every file's checksum and the manifest against one without.

Both kinds of save run in the same ranks (dp 1 x pp 2, ZeRO-1, fp32, a ~7M-parameter Llama: ~110 MB per
tag), alternated A B B A with a barrier before each, so machine load moves both alike; the ratio is the
median of the per-pair ratios of the save's wall time (the slowest rank's) and of its CPU time (summed over
the ranks: on a loaded machine the steadier of the two, since waiting for a core is not counted). "Without" is the save as it was
before manifests: no checksums computed, no manifest written. Also timed: checking a tag before a resume
(sizes and checksums of every file, and the weights-only pickle scan), on rank 0.

    python -m scripts.bench.checkpoint_sums [--pairs 8] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dsx3d.verify.harness import run_ranks, warm_up

MODEL = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 8192,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _recipe(out: Path, world: int) -> Any:
    from dsx3d.recipe.schema import recipe_from_dict
    from tests.helpers.recipes import tiny_recipe_dict

    return recipe_from_dict(
        tiny_recipe_dict(
            model={"config": MODEL},
            parallel={"dp": 1, "tp": 1, "pp": world},
            cluster={"nodes": 1, "gpus_per_node": world},
            zero={"stage": 1},
            output_dir=str(out),
        )
    )


def _worker(rank: int, out: str, world: int, pairs: int) -> dict[str, Any]:
    import dsx3d.checkpoint.training.checkpointer as checkpointer
    from dsx3d.checkpoint.training.tags import tag_problems
    from dsx3d.distributed import comm
    from dsx3d.engine import build_engine

    recipe = _recipe(Path(out), world)
    engine = build_engine(recipe)
    ckpt = checkpointer.Checkpointer(engine, Path(out) / "checkpoints", recipe, keep=2)
    real = (checkpointer.digest, checkpointer.write_sums, checkpointer.save_hashed)

    def save_plain(save: Any, path: Path) -> None:  # torch.save to the path, as DeepSpeed does
        with path.open("wb") as f:
            save(f)

    plain = (lambda path: (0, ""), lambda *args, **kwargs: None, save_plain)
    if os.environ.get("DSX3D_BENCH_ONLY") == "digest":  # isolate one part: "with" adds only the checksums
        real = (real[0], plain[1], real[2])
    elif os.environ.get("DSX3D_BENCH_ONLY") == "manifest":  # or only the manifest file
        real = (plain[0], real[1], plain[2])
    times: dict[str, list[float]] = {"with": [], "without": []}
    cpu: dict[str, list[float]] = {"with": [], "without": []}
    step = 0
    order = ["with", "without", "without", "with"] * ((pairs + 1) // 2)
    for kind in ["with", "without", *order[: 2 * pairs]]:  # the first two warm up
        checkpointer.digest, checkpointer.write_sums, checkpointer.save_hashed = real if kind == "with" else plain
        comm.barrier()
        began, began_cpu = time.perf_counter(), time.process_time()
        step += 1
        ckpt.save(step, {"step": step})
        took = comm.all_gather_object((time.perf_counter() - began, time.process_time() - began_cpu))
        if step > 2:
            times[kind].append(max(t for t, _ in took))
            cpu[kind].append(sum(c for _, c in took))
    checkpointer.digest, checkpointer.write_sums, checkpointer.save_hashed = real
    ckpt.save(step + 1, {"step": step + 1})
    tag_dir = Path(out) / "checkpoints" / f"step-{step + 1:06d}"
    began = time.perf_counter()
    problems = tag_problems(tag_dir) if rank == 0 else []
    check_s = time.perf_counter() - began
    tag_bytes = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())
    return {"times": times, "cpu": cpu, "check_s": check_s, "problems": problems, "tag_bytes": tag_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=20, help="A/B pairs of saves after one warm-up pair")
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args(argv)
    warm_up()
    with tempfile.TemporaryDirectory(prefix="dsx3d-bench-sums-") as out:
        res = run_ranks(_worker, args.world, out, args.world, args.pairs, timeout_s=1800)[0]
    with_s, without_s = res["times"]["with"], res["times"]["without"]
    ratios = [a / b for a, b in zip(with_s, without_s, strict=True)]
    cpu_ratios = [a / b for a, b in zip(res["cpu"]["with"], res["cpu"]["without"], strict=True)]
    report = {
        "tag_bytes": res["tag_bytes"],
        "pairs": len(ratios),
        "save_s_with_manifest_median": statistics.median(with_s),
        "save_s_without_median": statistics.median(without_s),
        "wall_ratio_median_of_pairs": statistics.median(ratios),
        "wall_ratio_of_medians": statistics.median(with_s) / statistics.median(without_s),
        "cpu_s_with_manifest_median": statistics.median(res["cpu"]["with"]),
        "cpu_s_without_median": statistics.median(res["cpu"]["without"]),
        "cpu_ratio_median_of_pairs": statistics.median(cpu_ratios),
        "check_before_resume_s": res["check_s"],
        "check_problems": res["problems"],
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
