"""The faults of the campaign: how each is injected into a running `dsx3d train` job, what its output must
say, and how the damage is undone before the resume (a full disk freed, a read-only directory made
writable again, as a user would).

The run directory lives on a small tmpfs of its own (the campaign mounts it; CI runs as root), so a full
disk is a real ENOSPC and a read-only directory a real EROFS (a read-only bind mount: root ignores file
modes).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dsx3d.run.relay import rank_processes
from scripts.faults import job

DAMAGE = ("truncated", "bitflip", "missing")
KINDS = (
    "sigterm-owner",
    "sigterm-twice",
    "sigkill-owner",
    "sigkill-rank",
    "sigkill-launcher",
    "sigstop-rank",
    "full-disk",
    "unwritable",
    *DAMAGE,
)
NEEDS_MOUNTS = ("full-disk", "unwritable")
DISK_BYTES = 64 << 20

# What the job's output says about each fault (any one of the phrases), when it ended because of it.
SAYS: dict[str, tuple[str, ...]] = {
    "sigterm-owner": ("stopped by SIGTERM after step",),
    "sigterm-twice": ("stopping at once", "stopped by SIGTERM after step"),
    "sigkill-owner": ("which started this job, has ended",),
    "sigkill-rank": ("died", "killed by sigkill"),
    "sigkill-launcher": ("the deepspeed launcher",),
    "sigstop-rank": ("is hung",),
    "full-disk": ("no space left on device",),
    "unwritable": ("read-only file system",),
    **{k: ("stopped by SIGTERM after step",) for k in DAMAGE},
}
COMPLETED = "done:"
"""What a job that finished every step says (a fault that landed after the work was done)."""


@dataclass
class Disk:
    """The campaign's tmpfs: the run directory is on it."""

    root: Path
    size: int = DISK_BYTES

    def mount(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.root)], check=True
        )

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.root)], check=False, capture_output=True)

    @property
    def filler(self) -> Path:
        return self.root / "filler"

    def fill(self) -> None:
        """Write until the disk is full."""
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError), self.filler.open("wb") as f:
            while True:
                f.write(chunk)
                f.flush()
        with contextlib.suppress(OSError), (self.root / "filler-tail").open("wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)
        (self.root / "filler-tail").unlink(missing_ok=True)

    @staticmethod
    def read_only(directory: Path) -> None:
        """Bind-mount `directory` on itself, read-only. The remount is refused (busy) while a file opened
        through the new bind is open for writing, which a job writing at that moment can do: tried again
        every 10 ms for up to 2 s."""
        subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
        for _ in range(200):
            done = subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True, text=True)
            if done.returncode == 0:
                return
            time.sleep(0.01)
        Disk.writable(directory)
        raise RuntimeError(f"could not make {directory} read-only: {done.stderr.strip()}")

    @staticmethod
    def writable(directory: Path) -> None:
        while subprocess.run(["umount", str(directory)], capture_output=True).returncode == 0:
            pass


def can_mount() -> bool:
    return (
        hasattr(os, "geteuid")
        and os.geteuid() == 0
        and Path("/proc/filesystems").read_text().find("tmpfs") >= 0
    )


def inject(kind: str, proc: subprocess.Popen, out: Path, disk: Disk, rng: random.Random) -> str:
    """Inject `kind` into the running job; '' or why it could not be injected."""
    if kind in ("sigterm-owner", *DAMAGE):
        os.kill(proc.pid, signal.SIGTERM)
    elif kind == "sigterm-twice":
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(rng.uniform(0.0, 0.5))
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    elif kind == "sigkill-owner":
        os.kill(proc.pid, signal.SIGKILL)
    elif kind in ("sigkill-rank", "sigstop-rank"):
        ranks = rank_processes(proc.pid)  # below `dsx3d train`: the launcher's agent's children
        if not ranks:
            return "no rank to signal"
        rng.choice(ranks).send_signal(signal.SIGKILL if kind == "sigkill-rank" else signal.SIGSTOP)
    elif kind == "sigkill-launcher":
        launcher = job.launcher_process(proc.pid)
        if launcher is None:
            return "no launcher to kill"
        launcher.kill()
    elif kind == "full-disk":
        disk.fill()
    elif kind == "unwritable":
        Disk.read_only(out / "checkpoints")
    return ""


def undo(kind: str, out: Path, disk: Disk) -> None:
    """What a user does before resuming: free the disk, make the directory writable again."""
    if kind == "full-disk":
        disk.free()
    elif kind == "unwritable":
        Disk.writable(out / "checkpoints")


def damage(kind: str, out: Path, rng: random.Random) -> Path | None:
    """Truncate, flip a bit of, or remove a random file of the newest checkpoint."""
    from dsx3d.checkpoint.training.disk_format import read_latest

    ckpt = out / "checkpoints"
    tag = read_latest(ckpt)
    if tag is None:
        return None
    return damage_file(kind, ckpt / tag, rng)


def damage_file(kind: str, tag_dir: Path, rng: random.Random) -> Path:
    """Truncate, flip one bit of, or delete a random non-empty file under `tag_dir`; returns the file."""
    files = sorted(p for p in tag_dir.rglob("*") if p.is_file() and p.stat().st_size > 0)
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
