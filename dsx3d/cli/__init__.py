"""`dsx3d` command line. Each subcommand lives in its own module with `register(subparsers)`.

Bad input (a `UserError`) prints every problem on stderr and exits 2, with no traceback. A command run with
`--json` prints exactly one JSON object on stdout; everything else goes to stderr (`json_output`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys

from dsx3d.cli.json_output import json_mode
from dsx3d.cli.registry import COMMANDS
from dsx3d.errors import UserError
from dsx3d.version import __version__


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Only the command named in `argv` (all of them when `argv` is None) is imported and
    registered with its options; the others appear in the command list by name and summary."""
    parser = argparse.ArgumentParser(prog="dsx3d", description="3D parallelism for Hugging Face models on DeepSpeed")
    parser.add_argument("--version", action="version", version=f"dsx3d {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    for name, (module, summary) in COMMANDS.items():
        if argv is None or name == wanted:
            importlib.import_module(f"dsx3d.cli.{module}").register(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    # force: each call writes to the sys.stderr of the moment (main runs in-process, several times, in tests)
    logging.basicConfig(level=logging.INFO, format="[dsx3d] %(message)s", stream=sys.stderr, force=True)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        with json_mode() if getattr(args, "json", False) else contextlib.nullcontext():
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
