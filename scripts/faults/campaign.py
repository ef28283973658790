"""A fault campaign against real `dsx3d train` jobs: each fault at seeded random moments, each outcome checked.

The job: the tiny Llama at dp 1 x tp 1 x pp 2 (two ranks through the deepspeed launcher), 24 steps of 8
micro-batches (long enough for a fault to land mid-run), a checkpoint every 4, two kept. One uninterrupted run is the reference. Each trial starts the job, waits for
a random step (and a random fraction of a second more), injects its fault, and checks:
- the job ended within BOUND_S of the fault, and no process of it is left;
- its output names the cause and holds no Python traceback;
- `dsx3d train --resume` (as many times as it takes, at most 2) ends with the reference's losses (every step,
  to 1e-6) and final weights (the exported model, to 1e-6).

Faults (kinds): sigterm-owner (a preemption notice: the ranks save and stop), sigterm-twice (a second
signal: stop at once), sigkill-owner, sigkill-rank, and, after a SIGTERM-stopped job, damage to a random file
of the newest checkpoint: truncated, bitflip, missing (the resume names the file and falls back).

    python -m scripts.faults.campaign [--trials 20] [--kinds sigterm-owner,...] [--seed 36] [--work DIR]

Prints the seed, one line per trial and the table: fault, trials, clean ends, exact resumes, worst time to end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

STEPS = 24
SAVE_INTERVAL = 4
BOUND_S = 120.0
LAUNCH_TIMEOUT_S = 600.0
KINDS = ("sigterm-owner", "sigterm-twice", "sigkill-owner", "sigkill-rank", "truncated", "bitflip", "missing")


def _recipe(path: Path, out: Path, cache: Path) -> Path:
    from tests.helpers.recipes import tiny_recipe_dict

    data = tiny_recipe_dict(
        parallel={"dp": 1, "tp": 1, "pp": 2},
        cluster={"nodes": 1, "gpus_per_node": 2},
        train={"steps": STEPS, "save_interval": SAVE_INTERVAL, "keep_checkpoints": 2, "gradient_accumulation_steps": 8},
        data={"cache_dir": str(cache)},
        output_dir=str(out),
    )
    path.write_text(yaml.safe_dump(data))
    return path


def _env(work: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions"), "PYTHONUNBUFFERED": "1"}


def _dsx3d() -> list[str]:
    beside = Path(sys.executable).parent / "dsx3d"  # the console script of this environment
    return [str(beside)] if beside.is_file() else [shutil.which("dsx3d") or "dsx3d"]


def _start(recipe: Path, work: Path, log: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*_dsx3d(), "train", str(recipe), *flags],
        env=_env(work),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _job_processes(recipe: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if str(recipe) in cmd and p.pid != os.getpid():
            out.append(p)
    return out


def _steps_done(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(line)["step"] for line in lines if line.strip().endswith("}")), default=0)
    except (OSError, ValueError, KeyError):
        return 0


def _losses(out: Path) -> list[float]:
    from dsx3d.run.metrics import read_metrics

    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def _weights(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v for f in sorted((out / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _kill_all(proc: subprocess.Popen, recipe: Path) -> None:
    for p in [*_job_processes(recipe)]:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


@dataclass
class Trial:
    kind: str
    moment: str = ""
    clean: bool = False
    exact: bool = False
    end_s: float = float("nan")
    notes: list[str] = field(default_factory=list)


def _damage(kind: str, ckpt: Path, rng: random.Random) -> Path:
    from dsx3d.checkpoint.training.disk_format import read_latest

    tag = read_latest(ckpt)
    assert tag is not None, "no checkpoint to damage"
    files = sorted(p for p in (ckpt / tag).rglob("*") if p.is_file() and p.stat().st_size > 0)
    victim = rng.choice(files)
    raw = victim.read_bytes()
    if kind == "truncated":
        victim.write_bytes(raw[: rng.randrange(len(raw))])
    elif kind == "bitflip":
        at = rng.randrange(len(raw))
        victim.write_bytes(raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1 :])
    else:
        victim.unlink()
    return victim


def run_trial(kind: str, rng: random.Random, work: Path, recipe: Path, out: Path, ref: tuple[list[float], dict[str, Any]]) -> Trial:
    trial = Trial(kind)
    shutil.rmtree(out, ignore_errors=True)
    log = work / f"{kind}.log"
    proc = _start(recipe, work, log, "--overwrite")
    at_step = rng.randint(1, STEPS - 2)
    extra = rng.uniform(0.0, 0.8)
    trial.moment = f"step {at_step} + {extra:.2f} s"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while _steps_done(out) < at_step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(extra)
    if proc.poll() is not None:
        trial.notes.append(f"the job ended before the fault (exit {proc.returncode})")
        return trial
    began = time.monotonic()
    expect: tuple[str, ...]
    if kind in ("sigterm-owner", "truncated", "bitflip", "missing"):
        os.kill(proc.pid, signal.SIGTERM)
        expect = ("stopped by SIGTERM after step", "checkpoint")
    elif kind == "sigterm-twice":
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(proc.pid, signal.SIGTERM)
        expect = ("SIGTERM",)
    elif kind == "sigkill-owner":
        os.kill(proc.pid, signal.SIGKILL)
        expect = ("which started this job, has ended",)
    else:  # sigkill-rank
        from dsx3d.run.relay import rank_processes

        ranks = rank_processes(proc.pid)
        victim = rng.choice(ranks) if ranks else None
        if victim is None:
            trial.notes.append("no rank to kill")
            _kill_all(proc, recipe)
            return trial
        victim.kill()
        expect = ("died",)
    code = _wait(proc, BOUND_S)
    while _job_processes(recipe) and time.monotonic() - began < BOUND_S:
        time.sleep(0.1)
    trial.end_s = time.monotonic() - began
    left = _job_processes(recipe)
    text = log.read_text(errors="replace")
    if code is None and kind != "sigkill-owner":
        trial.notes.append(f"did not end within {BOUND_S:.0f} s")
    if left:
        trial.notes.append(f"{len(left)} processes left")
    if "Traceback" in text:
        trial.notes.append("a traceback in the output")
    missing_words = [w for w in expect if w not in text]
    if missing_words:
        trial.notes.append(f"the output does not say {missing_words}")
    trial.clean = not trial.notes
    _kill_all(proc, recipe)
    if kind in ("truncated", "bitflip", "missing"):
        victim_file = _damage(kind, out / "checkpoints", rng)
        trial.moment += f", then {victim_file.name}"
    for attempt in range(2):
        rlog = work / f"{kind}.resume{attempt}.log"
        resumed = _start(recipe, work, rlog, "--resume")
        rc = _wait(resumed, LAUNCH_TIMEOUT_S)
        rtext = rlog.read_text(errors="replace")
        if rc is None:
            _kill_all(resumed, recipe)
        if kind in ("truncated", "bitflip", "missing") and attempt == 0 and "damaged" not in rtext:
            trial.notes.append("the resume did not name the damaged file")
        if rc == 0:
            break
        trial.notes.append(f"resume {attempt + 1} exited {rc}: {rtext.strip().splitlines()[-1:] }")
    losses, weights = ref
    got = _losses(out)
    same_losses = len(got) == len(losses) and all(abs(a - b) <= 1e-6 for a, b in zip(got, losses, strict=True))
    try:
        mine = _weights(out)
        same_weights = mine.keys() == weights.keys() and all(
            float((mine[k].float() - weights[k].float()).abs().max()) <= 1e-6 for k in weights
        )
    except (OSError, ValueError) as err:
        same_weights = False
        trial.notes.append(f"no exported weights ({err})")
    trial.exact = same_losses and same_weights
    if not same_losses:
        trial.notes.append(f"losses differ ({len(got)} steps)")
    if not same_weights:
        trial.notes.append("weights differ")
    return trial


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=int(os.environ.get("DSX3D_FAULTS", "1") or 1), help="trials per kind")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--work", default=None, help="a scratch directory (default: a new temporary one)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: --kinds: unknown {unknown}; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="dsx3d-faults-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    print(f"fault campaign: seed {args.seed}, {args.trials} trials per kind, work dir {work}", flush=True)
    cache, out = work / "cache", work / "run"
    recipe = _recipe(work / "recipe.yaml", out, cache)
    ref_recipe = _recipe(work / "reference.yaml", work / "reference", cache)
    ref_proc = _start(ref_recipe, work, work / "reference.log", "--overwrite")
    if _wait(ref_proc, LAUNCH_TIMEOUT_S) != 0:
        print((work / "reference.log").read_text()[-3000:], file=sys.stderr)
        return 1
    ref = (_losses(work / "reference"), _weights(work / "reference"))
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    for kind in kinds:
        for i in range(args.trials):
            t = run_trial(kind, random.Random(rng.random()), work, recipe, out, ref)
            trials.append(t)
            print(
                f"{kind} #{i + 1}: at {t.moment}: clean {t.clean}, exact {t.exact}, ended in {t.end_s:.1f} s"
                + (f"; {'; '.join(t.notes)}" if t.notes else ""),
                flush=True,
            )
    print("\n| fault | trials | clean ends | exact resumes | worst time to end |\n|---|---|---|---|---|")
    for kind in kinds:
        mine = [t for t in trials if t.kind == kind]
        worst = max((t.end_s for t in mine), default=float("nan"))
        print(f"| {kind} | {len(mine)} | {sum(t.clean for t in mine)} | {sum(t.exact for t in mine)} | {worst:.1f} s |")
    print(f"\nseed {args.seed}; load average {os.getloadavg()}")
    return 0 if all(t.clean and t.exact for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
