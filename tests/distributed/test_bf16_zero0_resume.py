"""bf16 without ZeRO in a pipeline (DeepSpeed's BF16_Optimizer, its fp32 master weights and moments split over
the data-parallel ranks) resumes: a run stopped after 2 steps and resumed for 2 more gives the losses of an
uninterrupted 4-step run, at dp 2 x pp 2 with an even [2, 2] split, so each DP rank must get its own part of
the optimizer back (the file rank 0 wrote holds only its own)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.verify.harness import run_ranks
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

WORLD = 4


def make_recipe(out: Path, cache: Path) -> Recipe:
    d = tiny_recipe_dict(
        model={"config": {"num_hidden_layers": 4}},
        parallel={"dp": 2, "tp": 1, "pp": 2, "stage_layers": [2, 2]},
        cluster={"nodes": 1, "gpus_per_node": WORLD},
        train={"steps": 4, "seq_len": 16, "micro_batch_size": 1, "dtype": "bf16", "save_interval": 2, "keep_checkpoints": 2},
        zero={"stage": 0},
        data={"cache_dir": str(cache)},
        output_dir=str(out),
    )
    return recipe_from_dict(d)


def _train(rank: int, recipe: Recipe, kwargs: dict[str, Any]) -> Any:
    from dsx3d.train import train

    return train(recipe, **kwargs)


def run(recipe: Recipe, **kwargs: Any) -> Any:
    return run_ranks(_train, WORLD, recipe, kwargs, timeout_s=300)[0]


def test_bf16_zero0_pipeline_resumes_every_dp_rank(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    whole = run(make_recipe(tmp_path / "whole", cache))
    recipe = make_recipe(tmp_path / "resumed", cache)
    first = run(recipe, stop_at=2)
    second = run(recipe, resume=True)
    assert (first.end_step, second.start_step, second.end_step) == (2, 2, 4)
    assert all(math.isfinite(x) for x in whole.losses) and whole.losses[0] != whole.losses[-1]
    assert first.losses + second.losses == pytest.approx(whole.losses, abs=1e-6, rel=0)
