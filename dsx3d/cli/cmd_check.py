"""`dsx3d check RECIPE`: every problem of a recipe at once, before any process starts.

Exit 0 when there is no error (warnings are allowed), 2 when there is at least one.
"""

from __future__ import annotations

import argparse

from dsx3d.checks import check_recipe
from dsx3d.cli.args import positive_int, world_size  # noqa: F401 (positive_int: for older imports)
from dsx3d.cli.layout_flags import add_cp_argument, recipe_with_cp
from dsx3d.cli.registry import summary


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help=summary("check"),
        description="Report every problem of a recipe at once. Exit 0 if only warnings, 2 on any error.",
    )
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument(
        "--world-size",
        type=world_size,
        help="number of ranks (default: cluster.nodes x cluster.gpus_per_node)",
    )
    add_cp_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problems = check_recipe(recipe_with_cp(args.recipe, args.cp), world_size=args.world_size)
    for problem in problems:
        print(problem)
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    print(f"{args.recipe}: {errors} error(s), {warnings} warning(s)" if problems else f"{args.recipe}: ok")
    return 2 if errors else 0
