"""Per-rank memory of loading a ~300M-parameter HF checkpoint at tp=2 x pp=2, against a plain from_pretrained.

A Llama checkpoint of 317M parameters (hidden 1024, 16 layers, MLP 4096, vocab 32000, untied) is written
with save_pretrained into a temporary directory (fp32 by default, sharded at 500MB). Then, in the same run:

- 3D: four forked ranks (dp=1, tp=2, pp=2) each verify the checkpoint and build their pipeline stage from
  it (`checkpoint_source` + `build_pipeline`, the engine's own path), then touch every weight. Per rank:
  the RSS delta over that, the peak (VmHWM, reset before loading) and the rank's own share (the bytes of
  the parameters it holds). Goal: delta <= about 1.15 x own share.
- HF: one forked process runs `AutoModelForCausalLM.from_pretrained(dtype=float32)` and touches every
  weight (from_pretrained memory-maps safetensors: untouched pages would not count).

    python -m scripts.bench.load_memory [--dtype fp32|bf16] [--no-write]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

GOAL = 1.15
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bench_model_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def touch(params: list[torch.Tensor]) -> float:
    """Read every byte of every weight (a lazily mapped tensor only counts once its pages are read)."""
    return float(sum(p.detach().float().sum().item() for p in params))


def rank_worker(rank: int, path: str) -> dict[str, Any]:
    from transformers import AutoConfig

    from dsx3d.checkpoint.hf.source import checkpoint_source
    from dsx3d.pipeline.module import build_pipeline
    from dsx3d.plan.layout import Layout

    config = AutoConfig.from_pretrained(path)
    layout = Layout(dp=1, tp=2, pp=2, gpus_per_node=4)
    gc.collect()
    before = bc.proc_status_kb("VmRSS")
    bc.reset_peak_rss()
    t0 = time.perf_counter()
    module = build_pipeline(config, layout, checkpoint_source(path, config), seq_len=128)
    seconds = time.perf_counter() - t0
    params = list({id(p): p for p in module.parameters()}.values())
    touch(params)
    gc.collect()
    after, peak = bc.proc_status_kb("VmRSS"), bc.proc_status_kb("VmHWM")
    own = sum(p.numel() * p.element_size() for p in params)
    placement = layout.placement(rank)
    return {
        "rank": rank,
        "pp": placement.pp,
        "tp": placement.tp,
        "params": sum(p.numel() for p in params),
        "own_share_mb": own / 2**20,
        "rss_delta_mb": (after - before) / 1024,
        "peak_delta_mb": (peak - before) / 1024,
        "load_s": seconds,
    }


def hf_worker(rank: int, path: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    gc.collect()
    before = bc.proc_status_kb("VmRSS")
    bc.reset_peak_rss()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seconds = time.perf_counter() - t0
    params = list(model.parameters())
    touch(params)
    gc.collect()
    after, peak = bc.proc_status_kb("VmRSS"), bc.proc_status_kb("VmHWM")
    own = sum(p.numel() * p.element_size() for p in params)
    return {
        "params": sum(p.numel() for p in params),
        "weights_mb": own / 2**20,
        "rss_delta_mb": (after - before) / 1024,
        "peak_delta_mb": (peak - before) / 1024,
        "load_s": seconds,
    }


def write_checkpoint(rank: int, path: str, dtype: str) -> int:
    """In a child of its own: the parent's heap stays small, so ranks forked later start clean (a forked
    rank reusing memory its parent freed would show a smaller RSS delta than it really needs)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(bench_model_config()).to(DTYPES[dtype])
    model.save_pretrained(path, max_shard_size="500MB")
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of the checkpoint on disk (the model loads in fp32)",
    )
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    warm_up()
    workdir = Path(tempfile.mkdtemp(prefix="dsx3d-bench-load-"))
    try:
        with bc.provenance(quick=False) as meta:
            n_params = run_ranks(write_checkpoint, 1, str(workdir / "ckpt"), args.dtype, timeout_s=1200)[0]
            ranks = run_ranks(rank_worker, 4, str(workdir / "ckpt"), timeout_s=1200)
            hf = run_ranks(hf_worker, 1, str(workdir / "ckpt"), timeout_s=1200)[0]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for r in ranks:
        r["ratio_to_own_share"] = r["rss_delta_mb"] / r["own_share_mb"]
        r["ratio_to_from_pretrained"] = r["rss_delta_mb"] / hf["rss_delta_mb"]
        for key in list(r):
            if isinstance(r[key], float):
                r[key] = bc.rounded(r[key])
    worst = max(r["ratio_to_own_share"] for r in ranks)
    result = {
        **meta,
        "what": "per-rank RSS delta of building a tp=2 x pp=2 stage from an HF checkpoint (weights touched) / the rank's own parameter bytes; and vs a plain from_pretrained in the same run",
        "model": {
            "params": n_params,
            "checkpoint_dtype": args.dtype,
            "model_dtype": "fp32",
            "shards": "500MB",
            "config": "llama h1024 L16 ffn4096 heads16/8 vocab32000 untied",
        },
        "ranks": ranks,
        "from_pretrained": {k: bc.rounded(v) if isinstance(v, float) else v for k, v in hf.items()},
        "worst_ratio_to_own_share": bc.rounded(worst),
        "goal": GOAL,
        "ok": worst <= GOAL,
    }
    for r in ranks:
        print(
            f"rank {r['rank']} (pp={r['pp']}, tp={r['tp']}): own share {r['own_share_mb']:.0f} MB, RSS delta "
            f"{r['rss_delta_mb']:.0f} MB (x{r['ratio_to_own_share']:.3f}), peak {r['peak_delta_mb']:.0f} MB, "
            f"{r['ratio_to_from_pretrained']:.2f} of from_pretrained, {r['load_s']:.1f}s",
            flush=True,
        )
    print(
        f"from_pretrained: weights {hf['weights_mb']:.0f} MB, RSS delta {hf['rss_delta_mb']:.0f} MB, peak {hf['peak_delta_mb']:.0f} MB, {hf['load_s']:.1f}s",
        flush=True,
    )
    bc.emit("load_memory", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
