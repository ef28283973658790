"""The checker is sound: every recipe it accepts trains (engine built, data prepared, one optimizer step,
checkpoint and HF export written), or, in fp16, is refused by DeepSpeed on CPU after the checker warned
about exactly that on train.dtype, and every recipe it refuses is refused before any process starts, with
each problem naming the recipe key, the reason and the fix. Recipes are drawn at random over the space a
user can write (tests.helpers.recipe_grid); CI draws until ACCEPTED of them were accepted (the refused ones
on the way are checked too); DSX3D_SWEEP=1 draws until 40 (DSX3D_SOUNDNESS_ACCEPTED sets the number)."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import pytest

from dsx3d.checks import check_recipe
from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.verify.harness import RankFailure, run_ranks
from tests.helpers.recipe_grid import random_recipe, write_corpus

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

SWEEP = bool(os.environ.get("DSX3D_SWEEP"))
ACCEPTED = int(os.environ.get("DSX3D_SOUNDNESS_ACCEPTED", "40" if SWEEP else "3"))
SEED = int(os.environ.get("DSX3D_SWEEP_SEED", "20261130"))
TOP_LEVEL = ("model.", "parallel.", "cluster.", "train.", "zero.", "data.", "deepspeed.", "output_dir")


def _judge(data: dict[str, Any]) -> tuple[Recipe | None, list[Any]]:
    try:
        recipe = recipe_from_dict(data)
    except UserError as err:
        return None, err.problems
    return recipe, [p for p in check_recipe(recipe) if p.severity == "error"]


def _train(rank: int, recipe: Recipe) -> list[float]:
    from dsx3d.train import train

    return train(recipe).losses


def test_accepted_recipes_train_and_refused_ones_name_the_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    rng = random.Random(SEED)
    shared = tmp_path_factory.mktemp("grid")
    write_corpus(shared)
    accepted = refused = fp16_refused = 0
    while accepted < ACCEPTED:
        tmp = tmp_path_factory.mktemp("case")
        data = random_recipe(rng, shared)
        data["output_dir"] = str(tmp / "run")
        recipe, errors = _judge(data)
        if errors:
            refused += 1
            for p in errors:
                assert p.key.startswith(TOP_LEVEL) and p.reason and p.fix, (p, data)
            continue
        assert recipe is not None
        accepted += 1
        world = recipe.cluster_world_size
        if recipe.train.dtype == "fp16":  # the checker warns; DeepSpeed refuses it on this CPU
            warned = [p for p in check_recipe(recipe) if p.severity == "warning" and p.key == "train.dtype"]
            assert warned and "fp16" in warned[0].reason, data
            try:
                losses = run_ranks(_train, world, recipe, timeout_s=600)[0]
            except RankFailure as err:
                assert "fp16 is not supported" in err.root_error, err.root_error
                fp16_refused += 1
                continue
        else:
            losses = run_ranks(_train, world, recipe, timeout_s=600)[0]
        assert len(losses) == 1 and math.isfinite(losses[0]), data
        assert (tmp / "run" / "hf" / "config.json").is_file(), data
    print(
        f"checker soundness: {accepted} accepted recipes trained ({fp16_refused} of them fp16, refused by DeepSpeed"
        f" on CPU as the checker warned), {refused} refused with a key (seed {SEED})"
    )
    assert refused > 0  # the grid reaches the checker's refusals too


def test_every_data_variant_trains_or_is_refused_with_the_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each chat / instruction / held-out data section of the grid (good and broken) on one small valid
    layout (dp 2 x pp 2, so the pipeline's eval_batch runs): accepted ones train a step, evaluate and export
    (CI trains the first 2 accepted, text and instruction data with held-out parts; DSX3D_SWEEP=1 all);
    refused ones name the key, the reason and the fix."""
    from dsx3d.recipe.ds_config import deep_merge
    from tests.helpers.recipe_grid import SFT_DATA, _fill
    from tests.helpers.recipes import tiny_recipe_dict

    shared = tmp_path_factory.mktemp("grid-data")
    write_corpus(shared)
    accepted, refused = [], []
    for i, variant in enumerate(SFT_DATA):
        base = tiny_recipe_dict(
            parallel={"dp": 2, "tp": 1, "pp": 2},
            model={"config": {"vocab_size": 320}},
            train={"steps": 1, "seq_len": 64, "eval_interval": 1},
            data={"tokenizer_vocab_size": 300, "cache_dir": str(shared / "cache")},
            output_dir=str(shared / f"run{i}"),
        )
        data = _fill(deep_merge(base, {"data": variant}), shared)
        recipe, errors = _judge(data)
        if errors:
            refused.append(variant)
            for p in errors:
                assert p.key.startswith(TOP_LEVEL) and p.reason and p.fix, (p, variant)
            continue
        assert recipe is not None
        accepted.append(variant)
        if len(accepted) > 2 and not SWEEP:  # chat: tests/distributed/test_sft_train.py
            continue
        losses = run_ranks(_train, 4, recipe, timeout_s=600)[0]
        assert len(losses) == 1 and math.isfinite(losses[0]), variant
        assert (shared / f"run{i}" / "hf" / "config.json").is_file(), variant
    print(f"data variants: {len(accepted)} accepted ({len(accepted) if SWEEP else min(2, len(accepted))} trained), {len(refused)} refused with a key")
    assert accepted and refused
