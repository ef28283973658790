"""A job ends with its owner, and a hung rank is found and named.

The job dies with its owner. `dsx3d train` (the owner) starts the deepspeed launcher, which starts a
per-node agent, which starts the ranks. Signals the owner can catch (Ctrl-C, SIGTERM, SIGHUP of a closed
terminal) it forwards to the launcher's process group. SIGKILL it cannot catch, so:
- the launcher is started with a parent-death signal (Linux PR_SET_PDEATHSIG): it is killed when the owner
  dies, however the owner dies;
- every rank is told who its owner is (DSX3D_OWNER: pid, start time, host) and a thread in each rank checks
  once a second that the owner still lives; when it is gone the rank says so and exits, and the per-node
  agent, seeing its ranks fail, ends too. Each rank also gets a parent-death signal for its own parent.
The start time makes a recycled pid harmless; the host check leaves ranks on other nodes to their own
node's owner (with `--no_ssh`, each node runs its own `dsx3d train`).

Hung ranks are found by heartbeat. A rank that is alive but stopped (SIGSTOP, a debugger, a deadlock holding
the GIL) keeps its peers waiting in a collective until the process-group timeout, and then nobody knows
which rank was stuck. Each rank writes a heartbeat file every few seconds into a host-local directory of the
job, and watches the heartbeats of the peers on its host: a peer whose process exists but whose heartbeat is
older than the hang timeout is hung. The rank that finds it names it (rank, node, host, pid, seconds since
its last heartbeat, its process state), leaves a marker so that peers stopping later name it too, and
exits; the launcher then ends the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:  # dsx3d.run.ranks imports torch.distributed; `dsx3d train` itself needs only Owner
    from dsx3d.run.ranks import RankInfo

log = logging.getLogger("dsx3d")

OWNER_ENV = "DSX3D_OWNER"  # also read by dsx3d/__init__.py, which starts the watch at import
_PR_SET_PDEATHSIG = 1
DEFAULT_HANG_TIMEOUT_S = 180.0


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent ends. False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# --- the owner -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Owner:
    pid: int
    started: float
    host: str

    def token(self) -> str:
        return f"{self.pid}:{self.started!r}:{self.host}"

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), psutil.Process().create_time(), socket.gethostname())

    @classmethod
    def parse(cls, token: str) -> Owner | None:
        try:
            pid, started, host = token.split(":", 2)
            return cls(int(pid), float(started), host)
        except ValueError:
            return None

    def alive(self) -> bool:
        try:
            p = psutil.Process(self.pid)
            return abs(p.create_time() - self.started) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


_watching = False


def _owner_gone(owner: Owner) -> None:
    log.error("dsx3d train (pid %d), which started this job, has ended: stopping this rank", owner.pid)
    _flush_and_exit(1)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def watch_owner(
    token: str | None = None, interval_s: float = 1.0, on_gone: Callable[[Owner], None] = _owner_gone
) -> threading.Thread | None:
    """In a rank: end it when the owner named by `token` (default: $DSX3D_OWNER) is gone. No-op without
    an owner on this host. Also sets this process's parent-death signal."""
    global _watching
    if token is None and _watching:  # already watching this process's owner
        return None
    token = token if token is not None else os.environ.get(OWNER_ENV)
    owner = Owner.parse(token) if token else None
    if owner is None or owner.host != socket.gethostname():
        return None
    _watching = _watching or token == os.environ.get(OWNER_ENV)
    set_parent_death_signal(signal.SIGTERM)

    def loop() -> None:
        while owner.alive():
            time.sleep(interval_s)
        on_gone(owner)

    thread = threading.Thread(target=loop, name="dsx3d-owner-watch", daemon=True)
    thread.start()
    return thread


def launcher_chain(max_depth: int = 4) -> list[tuple[Owner, str]]:
    """The launcher processes above this one, nearest first: its ancestors while they run Python (deepspeed's
    runner and its per-node launch.py, torchrun, `accelerate launch`), each with its command line. The chain
    stops at the first non-Python ancestor (a shell, a batch system, init)."""
    chain: list[tuple[Owner, str]] = []
    host = socket.gethostname()
    try:
        p = psutil.Process().parent()
        while p is not None and p.pid > 1 and len(chain) < max_depth:
            cmd = p.cmdline()
            if not cmd or not os.path.basename(cmd[0]).startswith("python"):
                break
            chain.append((Owner(p.pid, p.create_time(), host), " ".join(cmd[1:4])))
            p = p.parent()
    except psutil.Error:
        pass
    return chain


@contextlib.contextmanager
def watching_launchers(
    on_gone: Callable[[Owner, str], None],
    interval_s: float = 1.0,
    on_gone_at_exit: Callable[[Owner, str], None] | None = None,
) -> Iterator[None]:
    """Inside: a thread checks once per `interval_s` that every launcher above this process still runs
    (`launcher_chain`) and calls `on_gone` once for the first one that has ended. One that ended after the
    thread's last look (the work inside finished within `interval_s` of it) is given to `on_gone_at_exit`."""
    chain = launcher_chain()
    if not chain:
        yield
        return
    stop, fired = threading.Event(), threading.Event()

    def first_gone() -> tuple[Owner, str] | None:
        return next(((o, cmd) for o, cmd in chain if not o.alive()), None)

    def loop() -> None:
        while not stop.wait(interval_s):
            gone = first_gone()
            if gone is not None:
                fired.set()
                on_gone(*gone)
                return

    thread = threading.Thread(target=loop, name="dsx3d-launcher-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=interval_s + 1)
        if on_gone_at_exit is not None and not fired.is_set() and (gone := first_gone()) is not None:
            on_gone_at_exit(*gone)


# --- heartbeats ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hung:
    rank: int
    where: str
    silent_s: float
    state: str

    def describe(self) -> str:
        return f"{self.where} is hung: no heartbeat for {self.silent_s:.0f} s (process state: {self.state})"


def _state(pid: int) -> str | None:
    """The process state, or None when the process is gone (or a zombie: it ended, unreaped)."""
    try:
        state = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None
    return None if state == psutil.STATUS_ZOMBIE else str(state)


def beat_file(job_dir: Path, rank: int) -> Path:
    return job_dir / f"beat-rank-{rank}"


def hung_marker(job_dir: Path, rank: int) -> Path:
    return job_dir / f"hung-rank-{rank}"


def hung_peers(
    job_dir: Path, me: RankInfo, peers: list[RankInfo], timeout_s: float, since: float, now: float | None = None
) -> list[Hung]:
    """Peers on this host whose process lives but whose heartbeat is older than `timeout_s` (a peer that
    has not beaten yet counts from `since`; one that finished says "done")."""
    now = time.time() if now is None else now
    found = []
    for p in peers:
        if p.host != me.host or p.rank == me.rank:
            continue
        beat = beat_file(job_dir, p.rank)
        try:
            if beat.read_text().strip() == "done":
                continue
            last = beat.stat().st_mtime
        except OSError:
            last = since
        silent = now - max(last, since)
        if silent > timeout_s:
            state = _state(p.pid)
            if state is not None:
                found.append(Hung(p.rank, p.where(), silent, state))
    return found


def report_hung(job_dir: Path, me: RankInfo, hung: list[Hung]) -> None:
    name_hung(job_dir, me, hung)
    _flush_and_exit(1)


def name_hung(job_dir: Path, me: RankInfo, hung: list[Hung]) -> None:
    """Say which peers are hung, and leave markers so that peers stopping later name them too."""
    with contextlib.suppress(OSError):
        for h in hung:
            hung_marker(job_dir, h.rank).write_text(h.describe() + "\n")
        (job_dir / f"rank-{me.rank}").touch()  # this rank stopped on purpose: not a root cause
    log.error("%s stopped: %s", me.where(), "; ".join(h.describe() for h in hung))


@contextlib.contextmanager
def heartbeat(
    job_dir: Path,
    me: RankInfo,
    peers: list[RankInfo],
    timeout_s: float,
    on_hung: Callable[[Path, RankInfo, list[Hung]], None] = report_hung,
) -> Iterator[None]:
    """Beat and watch for the duration of the block (timeout_s <= 0: neither)."""
    if timeout_s <= 0:
        yield
        return
    job_dir.mkdir(parents=True, exist_ok=True)
    mine = beat_file(job_dir, me.rank)
    interval = max(0.2, min(5.0, timeout_s / 4))
    stop = threading.Event()
    since = time.time()

    def loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                mine.write_text(f"{time.time()}\n")
            hung = hung_peers(job_dir, me, peers, timeout_s, since)
            if hung and not stop.is_set():
                on_hung(job_dir, me, hung)
            stop.wait(interval)

    thread = threading.Thread(target=loop, name="dsx3d-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=interval + 1)
        with contextlib.suppress(OSError):
            mine.write_text("done\n")


def hung_reports(job_dir: Path) -> list[str]:
    """What the markers of hung ranks say (left by the rank that found them)."""
    if not job_dir.is_dir():
        return []
    out = []
    for marker in sorted(job_dir.glob("hung-rank-*")):
        with contextlib.suppress(OSError):
            out.append(marker.read_text().strip())
    return out
