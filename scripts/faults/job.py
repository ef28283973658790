"""One `dsx3d train` job of the fault campaign: its recipe, how it is started, watched and ended, and what it
left (steps, losses, exported weights). Used by scripts/faults/campaign.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

STEPS = 24
SAVE_INTERVAL = 4
HANG_TIMEOUT_S = 10.0
"""The heartbeat timeout the campaign's jobs run with (`--hang-timeout-s`): a stopped rank is named after it."""


def write_recipe(path: Path, out: Path, cache: Path, schedule: str = "1f1b") -> Path:
    """The tiny Llama at dp 1 x tp 1 x pp 2, STEPS steps of 8 micro-batches, a checkpoint every SAVE_INTERVAL, two
    kept, on the pipeline `schedule` (with the virtual stages the registry gives it, and a layer per stage)."""
    from dsx3d.pipeline.registry import get_schedule
    from tests.helpers.recipes import tiny_recipe_dict

    chunks = get_schedule(schedule).virtual_stages
    data = tiny_recipe_dict(
        model={"config": {"num_hidden_layers": 2 * chunks}},
        parallel={"dp": 1, "tp": 1, "pp": 2, "schedule": schedule, "virtual_stages": chunks},
        cluster={"nodes": 1, "gpus_per_node": 2},
        train={
            "steps": STEPS,
            "save_interval": SAVE_INTERVAL,
            "keep_checkpoints": 2,
            "gradient_accumulation_steps": 8,
        },
        data={"cache_dir": str(cache)},
        output_dir=str(out),
    )
    path.write_text(yaml.safe_dump(data))
    return path


def _dsx3d() -> list[str]:
    beside = Path(sys.executable).parent / "dsx3d"  # the console script of this environment
    return [str(beside)] if beside.is_file() else [shutil.which("dsx3d") or "dsx3d"]


def start(recipe: Path, work: Path, log: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions"), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [*_dsx3d(), "train", str(recipe), "--hang-timeout-s", str(HANG_TIMEOUT_S), *flags],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def processes(recipe: Path) -> list[psutil.Process]:
    """Every process of the job (their command lines name the recipe), stopped ones included."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if str(recipe) in cmd and p.pid != os.getpid():
            out.append(p)
    return out


def launcher_process(owner_pid: int) -> psutil.Process | None:
    """The deepspeed runner `dsx3d train` started (its child running deepspeed.launcher.runner)."""
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(owner_pid).children():
            if "deepspeed.launcher.runner" in p.cmdline():
                return p
    return None


def wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def wait_gone(recipe: Path, until: float) -> list[psutil.Process]:
    """Wait until no process of the job is left or `until` (monotonic) passes; what is left."""
    while (left := processes(recipe)) and time.monotonic() < until:
        time.sleep(0.1)
    return left


def kill_all(proc: subprocess.Popen, recipe: Path) -> None:
    for p in processes(recipe):
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def steps_done(out: Path) -> int:
    return max((r["step"] for r in metric_rows(out)), default=0)


def metric_rows(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as written, one record per line (a resume repeats steps after its checkpoint)."""
    rows = []
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def losses(out: Path) -> list[float]:
    from dsx3d.run.metrics import read_metrics

    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def weights(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v for f in sorted((out / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def same_weights(a: dict[str, Any], b: dict[str, Any], tol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(float((a[k].float() - b[k].float()).abs().max()) <= tol for k in a)


def latest_step(out: Path) -> int:
    """The step of the checkpoint a resume picks: the newest complete one (0: none)."""
    from dsx3d.checkpoint.training.tags import choose_tag

    with contextlib.suppress(Exception):
        tag, _ = choose_tag(out / "checkpoints")
        if tag:
            return int(tag.rsplit("-", 1)[-1])
    return 0
