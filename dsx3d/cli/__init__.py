"""`dsx3d` command line. Each subcommand lives in its own module with `register(subparsers)`.

Bad input (a `UserError`) prints every problem on stderr and exits 2, with no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dsx3d.errors import UserError

# Module names under dsx3d.cli; each defines register(subparsers) and sets a `func(args) -> int` default.
COMMANDS = [
    "cmd_plan",
    "cmd_check",
    "cmd_config",
    "cmd_verify",
    "cmd_estimate",
    "cmd_train",
    "cmd_export",
    "cmd_accelerate_config",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsx3d", description="3D parallelism for Hugging Face models on DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dsx3d.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # force: each call writes to the sys.stderr of the moment (main runs in-process, several times, in tests)
    logging.basicConfig(level=logging.INFO, format="[dsx3d] %(message)s", stream=sys.stderr, force=True)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        for problem in err.problems:
            print(str(problem), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
