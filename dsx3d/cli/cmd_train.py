"""`dsx3d train RECIPE [--hostfile H] [--resume | --overwrite] [launcher args...]`.

Checks the recipe (errors: exit 2, before any process starts), then runs the deepspeed launcher with the
recipe's process count and `--module dsx3d.train`. Arguments it does not know go to the launcher, e.g.
`--no_ssh --node_rank 1 --master_addr 10.0.0.1 --master_port 29500` to start one node of a job by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys

from dsx3d.checker import check_recipe, raise_for_errors
from dsx3d.cli.registry import summary
from dsx3d.recipe import load_recipe
from dsx3d.run.launch import check_hosts, launcher_command, rank_environment, read_hostfile
from dsx3d.run.outputs import RunPaths, add_start_mode, check_start

log = logging.getLogger("dsx3d")


def _own_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hostfile", help="DeepSpeed hostfile ('hostname slots=N' per node) for a multi-node job")
    add_start_mode(p)
    p.add_argument("--pg-timeout-s", type=float, help="process-group timeout of the ranks (default 600)")
    p.add_argument("--dry-run", action="store_true", help="print the launcher command and exit")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help=summary("train"),
        description="Check the recipe (errors: exit 2), then start cluster.gpus_per_node ranks per node through the "
        "deepspeed launcher. Unknown options go to the launcher.",
        epilog="Two nodes by hand: dsx3d train R --hostfile H --no_ssh --node_rank 0|1 --master_addr ADDR --master_port P",
    )
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    _own_options(p)
    p.add_argument("launcher_args", nargs=argparse.REMAINDER, help="options for the deepspeed launcher")
    p.set_defaults(func=run)


def split_args(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """Our options wherever they stand after RECIPE (argparse leaves them in the remainder), and the rest."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _own_options(own)
    later, launcher_args = own.parse_known_args(args.launcher_args)
    for name in ("hostfile", "resume", "overwrite", "pg_timeout_s", "dry_run"):
        setattr(later, name, getattr(later, name) or getattr(args, name))
    if later.resume and later.overwrite:
        raise SystemExit("dsx3d train: --resume and --overwrite exclude each other")
    return later, launcher_args


def run(args: argparse.Namespace) -> int:
    opts, launcher_args = split_args(args)
    recipe = load_recipe(args.recipe)
    raise_for_errors(check_recipe(recipe))
    check_start(RunPaths.of(recipe), resume=opts.resume, overwrite=opts.overwrite)
    if opts.hostfile is not None:
        check_hosts(read_hostfile(opts.hostfile), recipe)
    rank_args = ["--resume"] if opts.resume else ["--overwrite"] if opts.overwrite else []
    if opts.pg_timeout_s is not None:
        rank_args += ["--pg-timeout-s", str(opts.pg_timeout_s)]
    cmd = launcher_command(
        args.recipe, recipe, hostfile=opts.hostfile, launcher_args=launcher_args, rank_args=rank_args
    )
    log.info("launching: %s", shlex.join(cmd))
    if opts.dry_run:
        print(shlex.join(cmd))
        return 0
    return _run_launcher(cmd)


def _run_launcher(cmd: list[str]) -> int:
    # The launcher, its per-node agent and the ranks form their own process group, and Ctrl-C or a SIGTERM
    # sent to us stops all of them with a SIGTERM: the deepspeed runner itself dies of a SIGTERM without
    # passing it on (leaving the ranks running) and prints a traceback on SIGINT.
    proc = subprocess.Popen(cmd, env=rank_environment(), start_new_session=True)
    stopped_by: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = proc.wait()
    if stopped_by:
        print(f"dsx3d train: stopped ({signal.Signals(stopped_by[0]).name})", file=sys.stderr)
        return 128 + stopped_by[0]
    if code != 0:
        print(
            f"dsx3d train: the job failed ({describe_exit(code)}); the failing rank's message is above",
            file=sys.stderr,
        )
    return code if code >= 0 else 128 - code


def describe_exit(code: int) -> str:
    """The launcher exits with a failed rank's return code, a signal -N arriving as 256 - N."""
    if code > 256 - 64:
        with contextlib.suppress(ValueError):
            return f"launcher exit code {code}: a rank was killed by {signal.Signals(256 - code).name}"
    return f"launcher exit code {code}"
