"""`dsx3d train` with model.lora (dp1 tp2 pp2, forked gloo ranks, fp32): checkpoints carry the adapters and
their optimizer state, so a run stopped after 1 step and resumed for 1 more trains exactly like an
uninterrupted 2-step run (its loss, and the adapters after the second Adam update); the end of the run writes the adapter folder (peft's format) and, with
merge_on_export, the merged model, and neither holds a frozen weight's optimizer state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.verify.harness import run_ranks
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = pytest.mark.usefixtures("warm")

STEPS = 2


def _recipe(out: Path, cache: Path) -> Recipe:
    return recipe_from_dict(
        tiny_recipe_dict(
            model={"lora": {"r": 4, "target_modules": ["q_proj", "o_proj", "up_proj"], "init_lora_weights": False, "merge_on_export": True}},
            parallel={"dp": 1, "tp": 2, "pp": 2, "stage_layers": [1, 1]},
            cluster={"nodes": 1, "gpus_per_node": 4},
            train={"micro_batch_size": 1, "steps": STEPS, "lr": 1e-2, "lr_schedule": "cosine", "save_interval": 1},
            data={"cache_dir": str(cache)},
            output_dir=str(out),
        )
    )


def _train(rank: int, recipe: Recipe, kwargs: dict[str, Any]) -> Any:
    from dsx3d.train import train

    return train(recipe, **kwargs)


def _run(recipe: Recipe, **kwargs: Any) -> Any:
    return run_ranks(_train, 4, recipe, kwargs, timeout_s=300)[0]


def test_lora_run_resumes_exactly_and_exports(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    whole = _run(_recipe(tmp_path / "whole", cache))
    recipe = _recipe(tmp_path / "parts", cache)
    first = _run(recipe, stop_at=1)
    second = _run(recipe, resume=True)
    assert (first.end_step, second.start_step) == (1, 1)
    assert first.losses + second.losses == pytest.approx(whole.losses, abs=1e-6, rel=0)
    assert whole.losses[0] != whole.losses[-1]
    out = tmp_path / "parts"
    assert {p.name for p in (out / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert (out / "hf" / "config.json").is_file()
    # the last update used the Adam moments of step 1: restored from the checkpoint, the adapters match
    a = load_file(out / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "whole" / "adapter" / "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
