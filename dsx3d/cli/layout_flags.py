"""Layout options shared by the commands that read a recipe (`plan`, `check`, `config`): `--cp` and the
recipe it overrides. An override goes through the recipe's own validation, so a flag obeys the recipe's bounds
and a bad value is refused naming the flag's key, like a bad recipe value."""

from __future__ import annotations

import argparse
import logging

from dsx3d.cli.args import bounded_int
from dsx3d.recipe.schema import MAX_GPUS_PER_NODE, Recipe, load_recipe, recipe_from_dict

log = logging.getLogger("dsx3d")

cp_degree = bounded_int(1, MAX_GPUS_PER_NODE)


def add_cp_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cp",
        type=cp_degree,
        help="context-parallel degree: every sequence split over cp ranks next to the TP ranks "
        "(overrides parallel.cp; dp 'auto' then fills the world with dp x cp x tp x pp)",
    )


def recipe_with_cp(path: str, cp: int | None) -> Recipe:
    """The recipe at `path`, with parallel.cp = `cp` when given."""
    recipe = load_recipe(path)
    if cp is None or cp == recipe.parallel.cp:
        return recipe
    data = recipe.model_dump(mode="json", exclude_unset=True)
    data.setdefault("parallel", {})["cp"] = cp
    log.info("parallel.cp = %s (from --cp)", cp)
    return recipe_from_dict(data, source=path)
