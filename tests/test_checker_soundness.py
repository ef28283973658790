"""The checker is sound: every recipe it accepts trains (engine built, data prepared, one optimizer step,
checkpoint and HF export written), and every recipe it refuses is refused before any process starts, with
each problem naming the recipe key, the reason and the fix. Recipes are drawn at random over the space a
user can write (dsx3d.testing.recipe_grid); CI draws until ACCEPTED of them were accepted (the refused ones
on the way are checked too); DSX3D_SWEEP=1 draws until 40 (DSX3D_SOUNDNESS_ACCEPTED sets the number)."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import pytest

from dsx3d.checker import check_recipe
from dsx3d.errors import UserError
from dsx3d.recipe import Recipe, recipe_from_dict
from dsx3d.testing.harness import run_ranks
from dsx3d.testing.recipe_grid import random_recipe, write_corpus

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

SWEEP = bool(os.environ.get("DSX3D_SWEEP"))
ACCEPTED = int(os.environ.get("DSX3D_SOUNDNESS_ACCEPTED", "40" if SWEEP else "4"))
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
    accepted = refused = 0
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
        losses = run_ranks(_train, world, recipe, timeout_s=600)[0]
        assert len(losses) == 1 and math.isfinite(losses[0]), data
        assert (tmp / "run" / "hf" / "config.json").is_file(), data
    print(f"checker soundness: {accepted} accepted recipes trained, {refused} refused with a key (seed {SEED})")
    assert refused > 0  # the grid reaches the checker's refusals too
