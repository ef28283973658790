"""One launch of the Trainer face's training script (scripts/faults/trainer_run.py) under the deepspeed launcher,
and what the face reads and does around it: its processes, its progress, its results, damage to a checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from scripts.faults.inject import damage_file
from scripts.faults.trainer_run import ACCUM, MICRO, SEQ

SCRIPT = Path(__file__).with_name("trainer_run.py")
RECIPE = {
    "model": {"config": {"model_type": "llama"}},
    "parallel": {"dp": 1, "tp": 1, "pp": 2},
    "cluster": {"nodes": 1, "gpus_per_node": 2},
    "train": {
        "micro_batch_size": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "seq_len": SEQ,
        "dtype": "fp32",
    },
    "zero": {"stage": 1},
}


def write_recipe(path: Path) -> Path:
    path.write_text(yaml.safe_dump(RECIPE))
    return path


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (jobs that run at the same time need their own master port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    """A launch: the launcher's process (its own session), its output directory and its log."""

    proc: subprocess.Popen[bytes]
    out: Path
    log: Path
    started: float

    @classmethod
    def start(cls, out: Path, recipe: Path, log: Path, *flags: str) -> Job:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env.setdefault("TORCH_EXTENSIONS_DIR", str(out.parent / "torch_extensions"))
        out.mkdir(parents=True, exist_ok=True)
        log.with_suffix(".steps").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
               str(SCRIPT), "--out", str(out), "--recipe", str(recipe), "--steps-file", str(log.with_suffix(".steps")),
               *flags]  # fmt: skip
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(proc, out, log, time.monotonic())

    def processes(self) -> list[psutil.Process]:
        """Every process of this job still there (launcher, its agent, ranks): they all carry `--out OUT`."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if str(self.out) in cmd and p.pid != os.getpid():
                found.append(p)
        return found

    def ranks(self) -> list[psutil.Process]:
        return [
            p
            for p in self.processes()
            if any(a.startswith("--local_rank") for a in p.info.get("cmdline") or [])
        ]

    def steps_done(self) -> int:
        try:
            return len(self.log.with_suffix(".steps").read_text().split())
        except OSError:
            return 0

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """End whatever is left of the job (the face's own cleanup, after its checks)."""
        for p in self.processes():
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def losses(out: Path) -> list[float]:
    """Per-step losses of the run's log history (trainer_state.json, written at its end)."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h and "train_loss" not in h]


def weights(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v for f in sorted((out / "final").glob("*.safetensors")) for k, v in load_file(f).items()}


def checkpoints(out: Path) -> list[Path]:
    """checkpoint-N directories, newest first."""
    found = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True)


def damage(kind: str, ckpt: Path, rng: random.Random) -> Path:
    """Truncate, flip one bit of, or delete a random non-empty file of `ckpt`; returns the file."""
    return damage_file(kind, ckpt, rng)
