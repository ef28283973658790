"""A fault campaign against real `dsx3d train` jobs: each fault at seeded random moments, each outcome checked.

The job (scripts/faults/job.py): the tiny Llama at dp 1 x tp 1 x pp 2 (two ranks through the deepspeed
launcher), 24 steps of 8 micro-batches, a checkpoint every 4, two kept, its run directory on a small tmpfs
of its own. One uninterrupted run is the reference. The trials form one chain: each launch resumes the run
the previous fault stopped and is itself the target of the next fault, so a trial costs one launch. A
trial waits for a random step of its launch (half of them a checkpoint step, a fraction of a second later:
inside the save, the `latest` update or the deletion of an old tag), injects its fault
(scripts/faults/inject.py) and checks:
- clean end: every process of the job gone within BOUND_S of the fault; the output names the cause (or the
  job had finished its work) and holds no Python traceback;
- exact resume: the next launch (`--resume`, after the user's remedy: the disk freed, the directory
  writable again) trains at least one step, and every step it trains has the reference's loss (to 1e-6);
  a damaged checkpoint is named by it; every launch that finishes the run exports the reference's weights
  (to 1e-6). A last launch without a fault finishes the chain.

    python -m scripts.faults.campaign [--trials 20] [--kinds sigterm-owner,...] [--seed 36] [--schedule zb-v] [--work DIR]

Prints the seed, one line per trial and the table: fault, trials, clean ends, exact resumes, worst time to
end. Exit 0 when every trial is clean and exact.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsx3d.pipeline.registry import SCHEDULE_NAMES
from scripts.faults import job
from scripts.faults.inject import (
    COMPLETED,
    DAMAGE,
    KINDS,
    NEEDS_MOUNTS,
    SAYS,
    Disk,
    can_mount,
    damage,
    inject,
    undo,
)

BOUND_S = 120.0  # the job ended, every process gone, within this of the fault
KEEPS_EVERY_STEP = ("sigterm-owner", "sigkill-launcher")
"""Faults after which every rank finishes its step and saves: the resume must lose no completed step."""
STOPPED_BOUND_S = 30.0
"""A stopped rank: its peer names it after the hang timeout (10 s) and `dsx3d train` kills it within two
polls (dsx3d.run.relay.StoppedRankReaper), before the launcher's own 30 s grace would have."""
LAUNCH_TIMEOUT_S = 600.0


@dataclass
class Trial:
    kind: str
    moment: str = ""
    clean: bool = False
    exact: bool = False
    end_s: float = float("nan")
    notes: list[str] = field(default_factory=list)
    last_step: int | None = None
    """The last step the faulted launch completed (its last metrics row)."""


@dataclass
class Chain:
    """The campaign's state between launches."""

    work: Path
    recipe: Path
    out: Path
    disk: Disk
    reference: tuple[list[float], dict[str, Any]]
    step_s: float
    """The reference's wall time per step, saves included: the scale of a fault's moment within a step."""
    fresh: bool = True
    pending: Trial | None = None
    """The trial the next launch resumes after."""
    launches: int = 0

    def launch(self) -> tuple[Any, Path, int, int]:
        """Start the job; (process, log, rows of metrics.jsonl before it, the step it starts after)."""
        self.launches += 1
        log = self.work / f"launch-{self.launches:03d}.log"
        if self.fresh:  # --overwrite would clear it, but only once the ranks run: the old metrics would mislead
            shutil.rmtree(self.out, ignore_errors=True)
        start = 0 if self.fresh else job.latest_step(self.out)
        rows = 0 if self.fresh else len(job.metric_rows(self.out))
        proc = job.start(self.recipe, self.work, log, "--overwrite" if self.fresh else "--resume")
        return proc, log, rows, start

    def judge_resume(self, log: Path, rows_before: int, finished: bool) -> None:
        """The pending trial's resume was the launch that wrote `log` and the rows after `rows_before`."""
        trial, self.pending = self.pending, None
        if trial is None:
            return
        ref_losses, ref_weights = self.reference
        segment = job.metric_rows(self.out)[rows_before:]
        wrong = [r["step"] for r in segment if abs(r["loss"] - ref_losses[r["step"] - 1]) > 1e-6]
        if not segment and not finished:
            trial.notes.append("the resume trained no step")
        if wrong:
            trial.notes.append(f"the resume's losses differ at steps {wrong}")
        lost = (  # the stop's checkpoint is the step it completed
            trial.kind in KEEPS_EVERY_STEP
            and bool(segment)
            and trial.last_step is not None
            and segment[0]["step"] != trial.last_step + 1
        )
        if lost:
            trial.notes.append(f"the resume started at step {segment[0]['step']} after step {trial.last_step} had completed")
        unnamed = trial.kind in DAMAGE and "damaged" not in log.read_text(errors="replace")
        if unnamed:
            trial.notes.append("the resume did not name the damaged file")
        same = True
        if finished:
            try:
                same = job.same_weights(job.weights(self.out), ref_weights)
            except (OSError, ValueError) as err:
                same = False
                trial.notes.append(f"no exported weights ({err})")
            if not same:
                trial.notes.append("the exported weights differ")
        # A resume from the last step's checkpoint trains nothing; it must still finish and export the weights.
        trial.exact = (bool(segment) or finished) and not wrong and same and not unnamed and not lost

    def finished(self) -> bool:
        return job.steps_done(self.out) >= job.STEPS and (self.out / "hf").is_dir()


def _refused_as_promised(trial: Trial, code: int | None, log: Path) -> bool:
    """The damaged tag was the only one: `--resume` must exit 2 naming it (the run then starts over)."""
    return trial.kind in DAMAGE and code == 2 and "damaged:" in log.read_text(errors="replace")


def _moment(rng: random.Random, start: int, step_s: float) -> tuple[int, float]:
    """A step of the launch and a delay after its metrics line: within the step, or within the save after it."""
    saves = [s for s in range(start + 1, job.STEPS + 1) if s % job.SAVE_INTERVAL == 0]
    if saves and rng.random() < 0.5:
        return rng.choice(saves), rng.uniform(0.0, 2.0 * step_s)
    return rng.randint(min(start + 1, job.STEPS), job.STEPS), rng.uniform(0.0, step_s)


def _wait_for_step(chain: Chain, proc: Any, rows_before: int, step: int) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if any(r["step"] >= step for r in job.metric_rows(chain.out)[rows_before:]):
            return
        time.sleep(0.02)


def run_trial(chain: Chain, kind: str, rng: random.Random) -> Trial:
    trial = Trial(kind)
    for _attempt in range(3):  # a job that finished before the fault landed is started again
        proc, log, rows_before, start = chain.launch()
        step, extra = _moment(rng, start, chain.step_s)
        trial.moment = f"step {step} + {extra:.2f} s"
        _wait_for_step(chain, proc, rows_before, step)
        time.sleep(extra)
        if proc.poll() is not None:
            finished = proc.returncode == 0 and chain.finished()
            pending = chain.pending
            if pending is not None and _refused_as_promised(pending, proc.returncode, log):
                pending.exact, chain.pending = True, None  # no complete tag was left: exit 2, the file named
            if chain.pending is not None and not finished:
                chain.pending.notes.append(f"the resume exited {proc.returncode} before the next fault")
            chain.judge_resume(log, rows_before, finished)
            job.kill_all(proc, chain.recipe)
            chain.fresh = True
            continue
        return _inject_and_check(chain, trial, proc, log, rows_before, rng)
    trial.notes.append("the job finished before the fault three times")
    return trial


def _inject_and_check(
    chain: Chain, trial: Trial, proc: Any, log: Path, rows_before: int, rng: random.Random
) -> Trial:
    kind = trial.kind
    began = time.monotonic()
    why_not = inject(kind, proc, chain.out, chain.disk, rng)
    if why_not:
        trial.notes.append(why_not)
    code = job.wait(proc, BOUND_S)
    left = job.wait_gone(chain.recipe, began + BOUND_S)
    trial.end_s = time.monotonic() - began
    trained = job.metric_rows(chain.out)[rows_before:]
    trial.last_step = trained[-1]["step"] if trained else None
    text = log.read_text(errors="replace")
    finished = chain.finished() and COMPLETED in text
    if finished:  # the next launch starts over: nothing to resume
        trial.last_step = None
    if code is None and kind != "sigkill-owner":
        trial.notes.append(f"`dsx3d train` did not end within {BOUND_S:.0f} s")
    elif kind == "sigstop-rank" and trial.end_s > STOPPED_BOUND_S:
        trial.notes.append(f"a stopped rank ended the job in {trial.end_s:.1f} s, not within {STOPPED_BOUND_S:.0f} s")
    if left:
        trial.notes.append(f"{len(left)} processes left: {[p.pid for p in left]}")
    if "Traceback" in text:
        trial.notes.append("a traceback in the output")
    if not finished and not any(s.lower() in text.lower() for s in SAYS[kind]):
        trial.notes.append(f"the output does not say {SAYS[kind][0]!r}")
    job.kill_all(proc, chain.recipe)
    undo(kind, chain.out, chain.disk)
    trial.clean = not trial.notes
    chain.judge_resume(log, rows_before, finished)
    if kind in DAMAGE:  # a finished run's newest checkpoint too: its resume must fall back and train again
        victim = damage(kind, chain.out, rng)
        trial.moment += f", then {victim.name if victim else 'no file'}"
        finished = finished and victim is None
    chain.fresh = finished
    chain.pending = trial
    return trial


def run_campaign(kinds: list[str], trials: int, seed: int, work: Path, schedule: str = "1f1b") -> list[Trial]:
    disk = Disk(work / "disk")
    mounted = can_mount()
    if mounted:
        disk.mount()
    else:
        disk.root.mkdir(parents=True, exist_ok=True)
        skipped = [k for k in kinds if k in NEEDS_MOUNTS]
        if skipped:
            print(f"not root: {skipped} need mounts and are left out", flush=True)
            kinds = [k for k in kinds if k not in NEEDS_MOUNTS]
    try:
        cache = work / "cache"
        ref_recipe = job.write_recipe(work / "reference.yaml", work / "reference", cache, schedule)
        ref_proc = job.start(ref_recipe, work, work / "reference.log", "--overwrite")
        if job.wait(ref_proc, LAUNCH_TIMEOUT_S) != 0:
            raise SystemExit((work / "reference.log").read_text()[-3000:])
        reference = (job.losses(work / "reference"), job.weights(work / "reference"))
        rows = job.metric_rows(work / "reference")
        step_s = (rows[-1]["time"] - rows[0]["time"]) / max(1, len(rows) - 1)
        print(f"reference: {len(rows)} steps, {step_s * 1e3:.0f} ms per step with its saves", flush=True)
        out = disk.root / "run"
        chain = Chain(work, job.write_recipe(work / "recipe.yaml", out, cache, schedule), out, disk, reference, step_s)
        rng = random.Random(seed)
        draws = [k for k in kinds for _ in range(trials)]
        rng.shuffle(draws)
        done: list[Trial] = []
        for kind in draws:
            trial = run_trial(chain, kind, random.Random(rng.random()))
            done.append(trial)
            previous = done[-2] if len(done) > 1 else None
            if previous is not None:
                _say(previous, len(done) - 1)
        _finish_chain(chain)
        if done:
            _say(done[-1], len(done))
        return done
    finally:
        if mounted:
            Disk.writable(disk.root / "run" / "checkpoints")
            disk.unmount()


def _finish_chain(chain: Chain) -> None:
    proc, log, rows_before, _ = chain.launch()
    code = job.wait(proc, LAUNCH_TIMEOUT_S)
    if code != 0 and chain.pending is not None:
        chain.pending.notes.append(f"the last resume exited {code}")
    chain.judge_resume(log, rows_before, code == 0 and chain.finished())
    job.kill_all(proc, chain.recipe)


def _say(t: Trial, number: int) -> None:
    print(
        f"#{number} {t.kind}: at {t.moment}: clean {t.clean}, exact {t.exact}, ended in {t.end_s:.1f} s"
        + (f"; {'; '.join(t.notes)}" if t.notes else ""),
        flush=True,
    )


def table(kinds: list[str], trials: list[Trial]) -> str:
    lines = ["| fault | trials | clean ends | exact resumes | worst time to end |", "|---|---|---|---|---|"]
    for kind in kinds:
        mine = [t for t in trials if t.kind == kind]
        if mine:
            worst = max(t.end_s for t in mine)
            lines.append(
                f"| {kind} | {len(mine)} | {sum(t.clean for t in mine)} | {sum(t.exact for t in mine)} | {worst:.1f} s |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--trials", type=int, default=int(os.environ.get("DSX3D_FAULTS", "1") or 1), help="trials per kind"
    )
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--work", default=None, help="a scratch directory (default: a new temporary one)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES, help="the job's pipeline schedule")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: --kinds: unknown {unknown}; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="dsx3d-faults-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    print(f"fault campaign: seed {args.seed}, {args.trials} trials per kind, schedule {args.schedule}, work dir {work}", flush=True)
    began = time.monotonic()
    trials = run_campaign(kinds, args.trials, args.seed, work, args.schedule)
    print("\n" + table(kinds, trials))
    print(
        f"\nseed {args.seed}; {len(trials)} trials in {time.monotonic() - began:.0f} s; load average {os.getloadavg()}"
    )
    return 0 if trials and all(t.clean and t.exact for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
