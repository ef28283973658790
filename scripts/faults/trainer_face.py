"""The fault campaign's Trainer face: real `dsx3d.Trainer` jobs, each fault at seeded random moments, each outcome
checked.

The job (scripts/faults/trainer_run.py): a tiny Llama at dp 1 x tp 1 x pp 2, two ranks started as users start
them, `python -m deepspeed.launcher.runner --num_gpus 2 script.py`; 24 steps, a checkpoint every 4, two kept.
One uninterrupted run is the reference (it runs beside the first trial). Each trial starts the job, waits for
a random step and a random fraction of a second more, injects its fault, and checks:
- the job ended within BOUND_S of the fault, non-zero, and no process of it is left;
- its output names the cause and holds no Python traceback;
- the script run again with `--resume` (train(resume_from_checkpoint=True)) ends with the reference's losses
  (every step of trainer_state.json's log history, to 1e-6) and final weights (to 1e-6).

Faults (kinds): sigterm (to every rank, as a cluster does: the ranks save checkpoint-N and stop), sigterm-twice
(a second one within 0.5 s: the ranks stop at once, the last complete checkpoint kept), sigkill-rank (one rank;
its peer must name it), sigkill-launcher (deepspeed's runner, the command the user started: the ranks see it
gone, save and stop), sigstop-rank (one rank stops; its peer names it as hung after the job's 10 s hang
timeout and kills it), full-disk (the output directory's tmpfs filled at the moment: the next save fails,
named), unwritable (the output directory made read-only: the same), and, after a SIGTERM stop, damage to a
random file of the newest checkpoint-N: truncated, bitflip, missing (the resume names the file and falls back
to the checkpoint before; with none left it exits 2 naming it, and the face then starts over, as a user would).
Before the resume the disk is freed or the directory made writable again, as a user would. full-disk and
unwritable need mounts (root, as in CI); without them they are skipped and said so.

    python -m scripts.faults.trainer_face [--trials 1] [--kinds sigterm,...] [--seed 36] [--work DIR]

Prints the seed, one line per trial and the table: fault, trials, clean ends, exact resumes, worst time to end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from scripts.faults.inject import Disk, can_mount
from scripts.faults.trainer_job import Job, checkpoints, damage, losses, weights, write_recipe
from scripts.faults.trainer_run import STEPS

BOUND_S = 60.0
LAUNCH_TIMEOUT_S = 400.0
TOLERANCE = 1e-6
DAMAGE = ("truncated", "bitflip", "missing")
MOUNTS = ("full-disk", "unwritable")
KINDS = ("sigterm", "sigterm-twice", "sigkill-rank", "sigkill-launcher", "sigstop-rank", *MOUNTS, *DAMAGE)
EXPECT = {  # what the output says (lower case, any one of them) about each fault
    "sigterm": ("stopped by sigterm after step",),
    "sigterm-twice": ("stopping at once", "stopped by sigterm after step"),
    "sigkill-rank": ("died",),
    "sigkill-launcher": ("the launcher of this job",),
    "sigstop-rank": ("is hung",),
    "full-disk": ("no space left on device",),
    "unwritable": ("read-only file system",),
    **{k: ("stopped by sigterm after step",) for k in DAMAGE},
}
DISK_BYTES = 256 << 20
"""The tmpfs of the full-disk and unwritable trials: two checkpoints (about 47 MB each), one being written and
the final model fit."""


@dataclass
class Trial:
    kind: str
    moment: str = ""
    clean: bool = False
    exact: bool = False
    end_s: float = float("nan")
    notes: list[str] = field(default_factory=list)


class Reference:
    """The uninterrupted run, started at once and read when the first trial needs it."""

    def __init__(self, work: Path, recipe: Path):
        self.job = Job.start(work / "reference", recipe, work / "reference.log")
        self._result: tuple[list[float], dict[str, Any]] | None = None

    def result(self) -> tuple[list[float], dict[str, Any]]:
        if self._result is None:
            if self.job.wait(LAUNCH_TIMEOUT_S) != 0:
                self.job.kill()
                raise RuntimeError(f"the reference run failed:\n{self.job.text()[-3000:]}")
            self._result = (losses(self.job.out), weights(self.job.out))
        return self._result


def _inject(kind: str, job: Job, rng: random.Random, trial: Trial, disk: Disk | None) -> bool:
    ranks = job.ranks()
    if not ranks:
        trial.notes.append("no rank to signal")
        return False
    if kind in ("sigkill-rank", "sigstop-rank"):
        victim = rng.choice(ranks)
        trial.moment += f", rank pid {victim.pid}"
        victim.send_signal(signal.SIGKILL if kind == "sigkill-rank" else signal.SIGSTOP)
    elif kind == "sigkill-launcher":
        job.proc.kill()
    elif kind == "full-disk":
        assert disk is not None
        disk.fill()
    elif kind == "unwritable":
        Disk.read_only(job.out)
    else:
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        if kind == "sigterm-twice":
            time.sleep(rng.uniform(0.0, 0.5))
            for p in ranks:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGTERM)
    return True


def _check_end(kind: str, job: Job, began: float, trial: Trial) -> None:
    code = job.wait(BOUND_S)
    while job.processes() and time.monotonic() - began < BOUND_S:
        time.sleep(0.05)
    trial.end_s = time.monotonic() - began
    text = job.text()
    if code is None:
        trial.notes.append(f"did not end within {BOUND_S:.0f} s")
    elif code == 0 and kind != "sigkill-launcher":  # the launcher's code is the kill's; its ranks end alone
        trial.notes.append("exited 0 after a fault")
    if job.processes():
        trial.notes.append(f"{len(job.processes())} processes left")
    if "Traceback" in text:
        trial.notes.append("a traceback in the output")
    if not any(w in text.lower() for w in EXPECT[kind]):
        trial.notes.append(f"the output does not say {' or '.join(map(repr, EXPECT[kind]))}")
    trial.clean = not trial.notes


def _resume(name: str, work: Path, recipe: Path, out: Path, victim: Path | None, trial: Trial) -> bool:
    """Run the script again with --resume (starting over is right only when no complete checkpoint is left);
    whether it behaved: named the damaged file, no traceback, exit 0."""
    before = len(trial.notes)
    nothing_left = not any((c / "dsx3d_checkpoint.json").is_file() for c in checkpoints(out)) or (
        victim is not None and len(checkpoints(out)) == 1
    )
    job = Job.start(out, recipe, work / f"{name}.resume.log", "--resume")
    code, text = job.wait(LAUNCH_TIMEOUT_S), job.text()
    job.kill()
    if victim is not None and (str(victim) not in text or "damaged" not in text):
        trial.notes.append(f"the resume did not name the damaged file {victim}")
    if "Traceback" in text:
        trial.notes.append("a traceback in the resume's output")
    if code == 2 and nothing_left:
        trial.moment += "; no complete checkpoint left: exit 2, started over"
        job = Job.start(out, recipe, work / f"{name}.fresh.log")
        code, text = job.wait(LAUNCH_TIMEOUT_S), job.text()
        job.kill()
    if code != 0:
        trial.notes.append(f"the resume exited {code}: {text.strip().splitlines()[-1:]}")
    return len(trial.notes) == before


def _compare(out: Path, ref: tuple[list[float], dict[str, Any]], trial: Trial) -> bool:
    want_losses, want_weights = ref
    try:
        got, mine = losses(out), weights(out)
    except (OSError, ValueError, KeyError) as err:
        trial.notes.append(f"no results to compare ({type(err).__name__}: {err})")
        return False
    same_losses = len(got) == len(want_losses) and all(
        abs(a - b) <= TOLERANCE for a, b in zip(got, want_losses, strict=True)
    )
    same_weights = mine.keys() == want_weights.keys() and all(
        float((mine[k].float() - want_weights[k].float()).abs().max()) <= TOLERANCE for k in want_weights
    )
    if not same_losses:
        trial.notes.append(f"losses differ ({len(got)} of {len(want_losses)} steps)")
    if not same_weights:
        trial.notes.append("final weights differ")
    return same_losses and same_weights


def run_trial(
    kind: str, rng: random.Random, work: Path, recipe: Path, ref: Reference, name: str = "", disk: Disk | None = None
) -> Trial:
    """One trial; its logs are WORK/NAME.log (NAME: the kind by default), .resume.log and .fresh.log. full-disk
    and unwritable trials run in `disk` (a mounted tmpfs)."""
    name = name or kind
    trial, out = Trial(kind), (disk.root if disk is not None and kind in MOUNTS else work) / "run"
    for _attempt in range(3):  # a job that finished before the fault landed (a loaded machine) runs again
        shutil.rmtree(out, ignore_errors=True)
        job = Job.start(out, recipe, work / f"{name}.log")
        at_step, extra = rng.randint(1, STEPS - 4), rng.uniform(0.0, 0.1)
        trial.moment = f"step {at_step} + {extra:.2f} s"
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while job.steps_done() < at_step and job.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(extra)
        if job.proc.poll() is None or job.proc.returncode != 0:
            break
        job.kill()
    if job.proc.poll() is not None:
        trial.notes.append(f"the job ended before the fault (exit {job.proc.poll()})")
    if job.proc.poll() is not None or not _inject(kind, job, rng, trial, disk):
        job.kill()
        return trial
    _check_end(kind, job, time.monotonic(), trial)
    job.kill()
    if kind == "full-disk" and disk is not None:  # what a user does before resuming
        disk.free()
    elif kind == "unwritable":
        Disk.writable(out)
    victim = None
    if kind in DAMAGE:
        found = checkpoints(out)
        if not found:
            trial.notes.append("no checkpoint to damage")
            return trial
        victim = damage(kind, found[0], rng)
        trial.moment += f", then {victim.relative_to(out)}"
    behaved = _resume(name, work, recipe, out, victim, trial)
    trial.exact = _compare(out, ref.result(), trial) and behaved
    return trial


def table(kinds: list[str], trials: list[Trial]) -> str:
    lines = ["| fault | trials | clean ends | exact resumes | worst time to end |", "|---|---|---|---|---|"]
    for kind in kinds:
        mine = [t for t in trials if t.kind == kind]
        worst = max((t.end_s for t in mine), default=float("nan"))
        lines.append(
            f"| {kind} | {len(mine)} | {sum(t.clean for t in mine)} | {sum(t.exact for t in mine)} | {worst:.1f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1, help="trials per kind")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--work", default=None, help="a scratch directory (default: a new temporary one)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: --kinds: unknown {unknown}; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="dsx3d-trainer-faults-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"trainer fault campaign: seed {args.seed}, {args.trials} trials per kind, work dir {work}",
        flush=True,
    )
    disk: Disk | None = None
    if any(k in MOUNTS for k in kinds):
        if can_mount():
            disk = Disk(work / "disk", DISK_BYTES)
            disk.mount()
        else:
            print(f"skipped {[k for k in kinds if k in MOUNTS]}: they mount a tmpfs (root only)", flush=True)
            kinds = [k for k in kinds if k not in MOUNTS]
    recipe = write_recipe(work / "recipe.yaml")
    ref = Reference(work, recipe)
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    try:
        for kind in kinds:
            for i in range(args.trials):
                t = run_trial(kind, random.Random(rng.random()), work, recipe, ref, f"{kind}-{i + 1}", disk)
                trials.append(t)
                print(
                    f"{kind} #{i + 1}: at {t.moment}: clean {t.clean}, exact {t.exact}, ended in {t.end_s:.1f} s"
                    + (f"; {'; '.join(t.notes)}" if t.notes else ""),
                    flush=True,
                )
    finally:
        ref.job.kill()
        if disk is not None:
            disk.unmount()
    print("\n" + table(kinds, trials))
    print(f"\nseed {args.seed}; load average {os.getloadavg()}")
    return 0 if all(t.clean and t.exact for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
