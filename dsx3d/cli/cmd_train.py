"""`dsx3d train RECIPE [--hostfile H] [--resume | --overwrite] [launcher args...]`.

Checks the recipe (errors: exit 2, before any process starts), then runs the deepspeed launcher with the
recipe's process count and `--module dsx3d.train`. Arguments it does not know go to the launcher, e.g.
`--no_ssh --node_rank 1 --master_addr 10.0.0.1 --master_port 29500` to start one node of a job by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import signal
import subprocess
import sys

from dsx3d.checks import check_recipe, raise_for_errors
from dsx3d.cli.args import bounded_float
from dsx3d.cli.registry import summary
from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe, load_recipe
from dsx3d.run.launch import check_hosts, launcher_command, rank_environment, read_hostfile
from dsx3d.run.lifeline import DEFAULT_HANG_TIMEOUT_S, OWNER_ENV, Owner, set_parent_death_signal
from dsx3d.run.outputs import RunPaths, add_start_mode, check_start, describe_removal
from dsx3d.run.ports import with_master_port
from dsx3d.run.relay import SignalRelay, StoppedRankReaper, end_orphaned_job

log = logging.getLogger("dsx3d")

ORPHAN_GRACE_S = 60.0
_RESUME_HINT = "continue with --resume from the last complete checkpoint"


def _own_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hostfile", help="DeepSpeed hostfile ('hostname slots=N' per node) for a multi-node job")
    add_start_mode(p)
    p.add_argument(
        "--pg-timeout-s", type=bounded_float(0.0, 7 * 86400.0), help="process-group timeout of the ranks (default 600)"
    )
    p.add_argument(
        "--hang-timeout-s",
        type=bounded_float(0.0, 7 * 86400.0, low_open=False),
        help=f"name a rank whose heartbeat is silent this long as hung and end the job (default "
        f"{DEFAULT_HANG_TIMEOUT_S:g}; 0: off)",
    )
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
    for name in ("hostfile", "resume", "overwrite", "pg_timeout_s", "hang_timeout_s", "dry_run"):
        if getattr(later, name) in (None, False):
            setattr(later, name, getattr(args, name))
    if later.resume and later.overwrite:
        raise UserError.single("--resume --overwrite", None, "they exclude each other", "pass one of them")
    return later, launcher_args


def run(args: argparse.Namespace) -> int:
    opts, launcher_args = split_args(args)
    recipe = load_recipe(args.recipe)
    raise_for_errors(check_recipe(recipe))
    paths = RunPaths.of(recipe)
    removed = check_start(paths, resume=opts.resume, overwrite=opts.overwrite)
    if opts.hostfile is not None:
        check_hosts(read_hostfile(opts.hostfile), recipe)
    if opts.resume:
        _preview_resume(recipe, paths)
    if removed:
        log.info("%s (when the ranks start)", describe_removal(paths, removed, resume=opts.resume))
    rank_args = ["--resume"] if opts.resume else ["--overwrite"] if opts.overwrite else []
    if opts.pg_timeout_s is not None:
        rank_args += ["--pg-timeout-s", str(opts.pg_timeout_s)]
    if opts.hang_timeout_s is not None:
        rank_args += ["--hang-timeout-s", str(opts.hang_timeout_s)]
    launcher_args = with_master_port(launcher_args, recipe, hostfile=opts.hostfile)
    cmd = launcher_command(
        args.recipe, recipe, hostfile=opts.hostfile, launcher_args=launcher_args, rank_args=rank_args
    )
    log.info("launching: %s", shlex.join(cmd))
    if opts.dry_run:
        print(shlex.join(cmd))
        return 0
    return _run_launcher(cmd, save_on_signal=recipe.train.save_on_signal, grace_s=_grace_s(recipe))


def _grace_s(recipe: Recipe) -> float:
    """How long the ranks of a job whose launcher was killed get to save before they are killed."""
    deadline = recipe.train.signal_deadline_s
    return float(deadline) + 5.0 if deadline else ORPHAN_GRACE_S


def _preview_resume(recipe: Recipe, paths: RunPaths) -> None:
    """Say before any rank starts what the resume will do, and refuse one that cannot be exact (the ranks
    decide again, the same way, from the same files)."""
    from dsx3d.checkpoint.training.checkpointer import choose_tag
    from dsx3d.checkpoint.training.resume import plan_resume, read_saved
    from dsx3d.pipeline.module import engine_bounds
    from dsx3d.pipeline.registry import get_schedule
    from dsx3d.recipe.hf_config import load_hf_config

    tag, notes = choose_tag(paths.checkpoints)
    if tag is None:
        log.info("--resume: no checkpoint in %s yet: the run starts at step 0", paths.checkpoints)
        return
    layout, par = recipe.layout(), recipe.parallel
    bounds, _, _ = engine_bounds(  # as the ranks' engine holds them (virtual stages placed on the ranks)
        load_hf_config(recipe.model), layout.pp, recipe.train.seq_len, par.stage_layers, par.virtual_stages,
        get_schedule(par.schedule).placement,
    )
    plan = plan_resume(tag, *read_saved(paths.checkpoints / tag), recipe, layout, bounds)
    for note in [*notes, *plan.notes]:
        log.warning("--resume: %s", note)
    log.info("--resume: continuing from %s", paths.checkpoints / tag)


def _run_launcher(cmd: list[str], save_on_signal: bool = False, grace_s: float = 0.0) -> int:
    # The launcher, its per-node agent and the ranks form their own process group. Ctrl-C, SIGTERM, SIGUSR1
    # or SIGHUP (a closed terminal) sent to us goes to the ranks, which save and stop (train.save_on_signal,
    # dsx3d.run.relay); a second one, or any without save_on_signal, stops all of them with a SIGTERM: the
    # deepspeed runner itself dies of a SIGTERM without passing it on (leaving the ranks running) and prints
    # a traceback on SIGINT.
    # A SIGKILL cannot be caught: the launcher gets a parent-death signal, and the ranks watch this process
    # (dsx3d.run.lifeline), so nothing outlives us.
    env = {**rank_environment(), OWNER_ENV: Owner.me().token()}
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL)
    )
    relay = SignalRelay(proc.pid, save_on_signal).install()
    code = _wait(proc, StoppedRankReaper(proc.pid))
    if code < 0 and not relay.received:  # the launcher itself was killed (SIGKILL, the OOM killer)
        end_orphaned_job(proc.pid, code, grace_s)
        print(f"dsx3d train: the job ended without its launcher; {_RESUME_HINT}", file=sys.stderr)
        return 1
    stopped = relay.outcome(code)
    if stopped is not None:
        print(stopped[0], file=sys.stderr)
        return stopped[1]
    if code != 0:
        print(
            f"dsx3d train: the job failed ({describe_exit(code)}); the failing rank's message is above",
            file=sys.stderr,
        )
    return code if code >= 0 else 128 - code


def _wait(proc: subprocess.Popen[bytes], reaper: StoppedRankReaper, poll_s: float = 1.0) -> int:
    """Wait for the launcher, ending a stopped rank once the job is ending (dsx3d.run.relay)."""
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            reaper.poll()


def describe_exit(code: int) -> str:
    """The launcher exits with a failed rank's return code, a signal -N arriving as 256 - N."""
    if code > 256 - 64:
        with contextlib.suppress(ValueError):
            return f"launcher exit code {code}: a rank was killed by {signal.Signals(256 - code).name}"
    return f"launcher exit code {code}"
