"""Per-rank memory of building a ZeRO-3 engine without a pipeline: partitions per item vs the whole model.

A Llama of about 100M parameters (hidden 768, 12 layers, MLP 2048, vocab 32000, untied), freshly initialised
(the layout-independent init source), is built at dp 4 x tp 1 x pp 1 with ZeRO-3 by `build_engine`, on four
forked ranks, twice in the same run:

- per item (what dsx3d does): each pipeline item (embedding, decoder layer, final norm, head) is partitioned
  over the DP group as soon as its weights are read;
- whole model (what `deepspeed.initialize` alone would do): every rank materialises the whole model, which
  DeepSpeed partitions afterwards.

Per rank, over base RSS (VmHWM reset before the build): the peak while the model is built (up to
`deepspeed.initialize`) and the peak of the whole `build_engine` (DeepSpeed's ZeRO-3 optimizer adds its flat
fp32 partitions and buffers), against the model's fp32 bytes. Goal: the per-item model-build peak stays
well under the whole model.

    MALLOC_MMAP_THRESHOLD_=65536 python -m scripts.bench.zero3_build

glibc keeps freed blocks of a few MB in its heap once a large block has been freed (its mmap threshold
grows), so RSS keeps tensors that no longer exist; a fixed threshold makes large tensors mmapped and RSS
follow what is alive. Without it the same comparison holds with noisier peaks.
"""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

DP = 4


def model_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def recipe() -> Any:
    from dsx3d.recipe.schema import recipe_from_dict

    config = {k: v for k, v in model_config().to_diff_dict().items() if not k.startswith("_")}
    return recipe_from_dict(
        {
            "model": {"config": {**config, "model_type": "llama"}},
            "parallel": {"dp": DP, "tp": 1, "pp": 1},
            "cluster": {"nodes": 1, "gpus_per_node": DP},
            "train": {
                "micro_batch_size": 1,
                "gradient_accumulation_steps": 1,
                "seq_len": 64,
                "dtype": "fp32",
            },
            "zero": {"stage": 3},
        }
    )


def rank_worker(rank: int, per_item: bool) -> dict[str, Any]:
    import dsx3d.engine.builder as engine_module

    if not per_item:
        engine_module._zero3_partitioner = lambda ds_config, mpu: None  # type: ignore[assignment]
    import deepspeed

    built: dict[str, int] = {}
    initialize = deepspeed.initialize

    def timed_initialize(*args: Any, **kwargs: Any) -> Any:
        built["peak"] = bc.proc_status_kb("VmHWM")  # the model is built, the engine not yet
        return initialize(*args, **kwargs)

    deepspeed.initialize = timed_initialize  # type: ignore[assignment]
    gc.collect()
    base = bc.proc_status_kb("VmRSS")
    bc.reset_peak_rss()
    run = engine_module.build_engine(recipe())
    peak = bc.proc_status_kb("VmHWM")
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in run.module.parameters())
    return {
        "model_build_peak_mib": (built["peak"] - base) / 1024,
        "engine_build_peak_mib": (peak - base) / 1024,
        "model_mib": numel * 4 / 2**20,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    warm_up()
    out: dict[str, Any] = {
        "what": "peak RSS of building a ZeRO-3 engine at dp 4 (pp 1), per rank",
        "machine": bc.machine(),
    }
    for mode, per_item in (("per_item", True), ("whole_model", False)):
        rows = run_ranks(rank_worker, DP, per_item, timeout_s=1200)
        out[mode] = {
            "model_build_peak_mib": [round(r["model_build_peak_mib"], 1) for r in rows],
            "engine_build_peak_mib": [round(r["engine_build_peak_mib"], 1) for r in rows],
            "model_mib": round(rows[0]["model_mib"], 1),
        }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
