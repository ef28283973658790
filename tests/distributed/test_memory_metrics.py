"""Memory you can see: a short `dsx3d train` (4 forked ranks, dp1 tp2 pp2, the tiled loss on) writes each
logging interval's peak memory of every rank to metrics.jsonl, its maximum, its rank and each pipeline stage's
maximum; and the CPU meter reports the peak of its own interval (VmHWM, reset through /proc/self/clear_refs),
not the process's peak since it started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.run.memory import GB, MemoryRecord, PeakMemory
from dsx3d.run.metrics import read_metrics
from dsx3d.run.progress import format_log_line
from dsx3d.verify.harness import run_ranks

STEPS = 3


def _recipe(tmp: Path) -> Recipe:
    return recipe_from_dict(
        {
            "model": {
                "config": {
                    "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 512,
                    "max_position_embeddings": 64, "tie_word_embeddings": False,
                }
            },
            "parallel": {"dp": 1, "tp": 2, "pp": 2},
            "cluster": {"nodes": 1, "gpus_per_node": 4},
            "train": {
                "steps": STEPS, "seq_len": 32, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
                "dtype": "fp32", "log_interval": 2, "loss_tile_tokens": 24, "warmup_steps": 1,
            },
            "zero": {"stage": 1},
            "data": {"tokenizer_vocab_size": 512, "cache_dir": str(tmp / "cache")},
            "output_dir": str(tmp / "run"),
        }
    )


def _train(rank: int, recipe: Recipe) -> list[float]:
    from dsx3d.train import train

    return train(recipe).losses


@pytest.mark.usefixtures("warm")
def test_train_writes_each_ranks_interval_peak(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)
    losses = run_ranks(_train, 4, recipe, timeout_s=600)[0]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]  # the first step, every log_interval, the last
    for r in records:
        by_rank = r["peak_mem_gb_by_rank"]
        assert len(by_rank) == 4 and all(0.01 < gb < 64 for gb in by_rank), by_rank
        assert r["peak_mem_gb"] == max(by_rank) and by_rank[r["peak_mem_rank"]] == r["peak_mem_gb"]
        # DeepSpeed's topology for pp2 x tp2: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1
        assert r["peak_mem_gb_by_stage"] == [max(by_rank[:2]), max(by_rank[2:])]
        assert r["peak_mem_kind"] in ("rss_interval", "rss_process")
        assert f"peak mem {r['peak_mem_gb']:.2f} GB on rank {r['peak_mem_rank']}" in format_log_line(r, STEPS)


def test_cpu_meter_reports_the_interval_peak() -> None:
    meter = PeakMemory("cpu")
    if meter.kind != "rss_interval":
        pytest.skip("/proc/self/clear_refs is not writable here: only the process peak exists")
    meter.start()
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    del big
    first = meter.read()
    second = meter.read()  # nothing big in this interval
    assert first - second > 48 * 1024 * 1024, (first, second)


def test_record_fields_by_stage() -> None:
    record: dict[str, Any] = MemoryRecord([1.0, 3.0, 2.0, 0.5], [0, 0, 1, 1], "rss_interval").fields()
    assert record["peak_mem_gb"] == 3.0 and record["peak_mem_rank"] == 1
    assert record["peak_mem_gb_by_stage"] == [3.0, 2.0]
    assert GB == 1024**3
