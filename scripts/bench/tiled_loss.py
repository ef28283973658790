"""Peak memory of the last stage with tiled logits and loss (`train.loss_tile_tokens`) against full logits.

A one-layer Llama of width 64 with Qwen2's 151,936-token vocabulary (untied head) is built by `build_engine`
on one forked rank (pp = 1, tp = 1: the stage is the whole model, and the head and its loss are nearly all
of its activation memory), fp32, ZeRO-0. Each variant runs in its own forked process: one warm-up step
(Adam allocates its moments), then the peak resident set over one more optimizer step, measured as VmHWM
after resetting it through /proc/self/clear_refs, minus the resident set before the step. Large allocations
are mapped and unmapped on their own (`mallopt(M_MMAP_THRESHOLD, 64 KiB)`), so the resident set follows the
live tensors instead of the allocator's free lists. The variants alternate (full, tiled, tiled, full, ...)
and the ratio is tiled / full of the medians. A third step, profiled (`profile_memory`), gives the peak of live tensor
bytes from torch's allocator events: the same quantity without the resident set's noise (a child forked from a large
process can see pages shared, reused or reclaimed), which the smoke test holds to.

    python -m scripts.bench.tiled_loss [--quick] [--seq-len 2048] [--tile 256] [--rounds 2] [--no-write]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

VOCAB = 151936


def recipe(vocab: int, seq_len: int, tile: int) -> Any:
    from dsx3d.recipe.schema import recipe_from_dict

    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": vocab,
        "max_position_embeddings": seq_len, "tie_word_embeddings": False,
    }
    return recipe_from_dict(
        {
            "model": {"config": config},
            "parallel": {"dp": 1, "tp": 1, "pp": 1},
            "cluster": {"nodes": 1, "gpus_per_node": 1},
            "train": {
                "micro_batch_size": 1, "gradient_accumulation_steps": 1, "seq_len": seq_len, "dtype": "fp32",
                "loss_tile_tokens": tile,
            },
            "zero": {"stage": 0},
        }
    )


def rank_worker(rank: int, vocab: int, seq_len: int, tile: int) -> dict[str, Any]:
    from dsx3d.engine.builder import build_engine

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    engine = build_engine(recipe(vocab, seq_len, tile))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    engine.train_step(iter([(ids, ids)]))  # Adam's moments exist from here on
    if not bc.reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs is not writable: the peak RSS cannot be reset")
    before = bc.proc_status_kb("VmRSS")
    loss = engine.train_step(iter([(ids, ids)]))
    peak = bc.proc_status_kb("VmHWM")
    allocated = bc.peak_tensor_bytes(lambda: engine.train_step(iter([(ids, ids)])))
    return {
        "peak_over_start_mib": (peak - before) / 1024, "rss_before_mib": before / 1024, "loss": loss,
        "peak_allocated_mib": allocated / 2**20,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="vocabulary 32000, seq_len 512: a smoke run")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (full and tiled alternating)")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    vocab, seq_len = (32000, 512) if args.quick else (VOCAB, args.seq_len)
    warm_up()
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "tiled": []}
    with bc.provenance(args.quick) as meta:
        for i in range(args.rounds):
            order = ("full", "tiled") if i % 2 == 0 else ("tiled", "full")
            for name in order:
                tile = 0 if name == "full" else args.tile
                runs[name].append(run_ranks(rank_worker, 1, vocab, seq_len, tile, timeout_s=900)[0])
    full = statistics.median(r["peak_over_start_mib"] for r in runs["full"])
    tiled = statistics.median(r["peak_over_start_mib"] for r in runs["tiled"])
    allocated = {k: statistics.median(r["peak_allocated_mib"] for r in v) for k, v in runs.items()}
    logits_mib = seq_len * vocab * 4 / 2**20
    result = {
        **meta,
        "what": "peak RSS over one optimizer step (above the RSS before it) of the last stage, tiled logits and "
        "loss against full logits; one forked process per run, fp32, ZeRO-0, pp 1, tp 1",
        "model": {"hidden": 64, "layers": 1, "vocab": vocab, "tied": False},
        "seq_len": seq_len,
        "loss_tile_tokens": args.tile,
        "rounds": args.rounds,
        "full_logits_fp32_mib": bc.rounded(logits_mib),
        "tile_logits_fp32_mib": bc.rounded(args.tile * vocab * 4 / 2**20),
        "peak_over_start_mib": {k: [bc.rounded(r["peak_over_start_mib"]) for r in v] for k, v in runs.items()},
        "median_peak_over_start_mib": {"full": bc.rounded(full), "tiled": bc.rounded(tiled)},
        "ratio_tiled_over_full": bc.rounded(tiled / full),
        "peak_allocated_mib": {k: [bc.rounded(r["peak_allocated_mib"]) for r in v] for k, v in runs.items()},
        "median_peak_allocated_mib": {k: bc.rounded(v) for k, v in allocated.items()},
        "ratio_tiled_over_full_allocated": bc.rounded(allocated["tiled"] / allocated["full"]),
        "losses": {k: [bc.rounded(r["loss"], 7) for r in v] for k, v in runs.items()},
    }
    bc.emit("tiled_loss" if not args.quick else "tiled_loss_quick", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
