"""`dsx3d accelerate-config RECIPE -o FILE.yaml`: an accelerate launch config and the DeepSpeed JSON it names."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsx3d.checks import check_recipe, raise_for_errors
from dsx3d.cli.args import output_file, port
from dsx3d.cli.registry import summary
from dsx3d.errors import UserError
from dsx3d.recipe.accelerate_config import accelerate_config, write_accelerate_config
from dsx3d.recipe.ds_config import write_ds_config
from dsx3d.recipe.schema import load_recipe


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "accelerate-config",
        help=summary("accelerate-config"),
        description="Check the recipe (errors: exit 2), write its DeepSpeed JSON and an accelerate config naming it, "
        "with the recipe's process and machine counts. Then: accelerate launch --config_file FILE.yaml SCRIPT.",
    )
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("-o", "--output", required=True, help="accelerate config to write (YAML)")
    p.add_argument(
        "--ds-config", help="DeepSpeed JSON to write (default: next to the output, <name>.ds.json)"
    )
    p.add_argument(
        "--main-process-ip", help="address of the node with machine_rank 0 (required for several nodes)"
    )
    p.add_argument("--main-process-port", type=port, default=29500, help="its port (default: 29500)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    output = output_file("--output", args.output)
    ds_path = Path(args.ds_config) if args.ds_config else output.with_name(f"{output.stem}.ds.json")
    output_file("--ds-config", str(ds_path))
    if output.absolute() == ds_path.absolute():
        raise UserError.single("--ds-config", str(ds_path), "is the accelerate config itself", "name another file")
    if args.main_process_ip is not None and (not args.main_process_ip.strip() or any(c.isspace() or c == "\x00" for c in args.main_process_ip)):
        raise UserError.single("--main-process-ip", args.main_process_ip, "not a host name or address", "pass one such as 10.0.0.1")
    raise_for_errors(check_recipe(recipe))
    config = accelerate_config(
        recipe, ds_path, main_process_ip=args.main_process_ip, main_process_port=args.main_process_port
    )
    write_ds_config(recipe, ds_path)
    print(write_accelerate_config(config, output))  # on stdout, for scripts
    return 0
