"""`dsx3d config RECIPE`: write the DeepSpeed JSON of a recipe, after the checker accepted it."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsx3d.checks import check_recipe, raise_for_errors
from dsx3d.cli.args import output_file, world_size
from dsx3d.cli.layout_flags import add_cp_argument, recipe_with_cp
from dsx3d.cli.registry import summary
from dsx3d.recipe.ds_config import write_ds_config


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config",
        help=summary("config"),
        description="Check the recipe (errors: exit 2), then write its DeepSpeed JSON.",
    )
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("-o", "--output", help="output file (default: ds_configs/<recipe name>.json)")
    p.add_argument(
        "--world-size",
        type=world_size,
        help="number of ranks (default: cluster.nodes x cluster.gpus_per_node)",
    )
    add_cp_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = recipe_with_cp(args.recipe, args.cp)
    output = Path(args.output) if args.output else Path("ds_configs") / f"{Path(args.recipe).stem}.json"
    output_file("--output", str(output))
    raise_for_errors(check_recipe(recipe, world_size=args.world_size))
    path = write_ds_config(recipe, output, world_size=args.world_size)
    print(path)  # on stdout, for scripts
    return 0
