"""The split by measured cost (dsx3d/pipeline/measured_split.py): min-max over measured item times, every stage
keeping a decoder layer, the memory limit as a constraint, and the timing of real HF items."""

from __future__ import annotations

import pytest

from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline.measured_split import item_seconds, measured_stage_layers


def test_a_heavy_head_moves_layers_to_the_first_stage() -> None:
    seconds = {"embedding": 0.0, "layer": 1.0, "head": 6.0}
    assert measured_stage_layers(seconds, 10, 2) == [8, 2]  # 8 | 2 + 6
    assert measured_stage_layers({"embedding": 0.0, "layer": 1.0, "head": 0.0}, 10, 2) == [5, 5]


def test_memory_limit_takes_the_best_split_that_fits() -> None:
    seconds = {"embedding": 0.0, "layer": 1.0, "head": 6.0}
    params = [100, *[10] * 10, 0, 100]  # embedding, 10 layers, norm, head
    assert measured_stage_layers(seconds, 10, 2, params, memory_limit=200) == [8, 2]
    assert measured_stage_layers(seconds, 10, 2, params, memory_limit=150) == [5, 5]  # 100 + 8*10 does not fit
    with pytest.raises(ValueError, match="no split"):
        measured_stage_layers(seconds, 10, 2, params, memory_limit=100)


def test_item_seconds_times_each_item() -> None:
    config = tiny_config("llama")
    seconds = item_seconds(config, micro_batch=1, seq_len=16, reps=1)
    assert set(seconds) == {"embedding", "layer", "head"}
    assert all(s > 0 for s in seconds.values())
