"""How `dsx3d train` passes a stop signal to its job: to the ranks for a save, or to the launcher to stop at once.

With `train.save_on_signal` the first SIGTERM, SIGINT, SIGUSR1 or SIGHUP the owner receives goes to the
rank processes on this node only (SIGHUP as SIGTERM): they finish their step, save, and exit; the deepspeed
launcher and its per-node agent, which would kill the ranks on a signal of their own, are left alone. A
second signal, or a first one without `train.save_on_signal`, stops the launcher's whole process group at
once (as before): `latest` keeps naming the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import psutil

RANK_MODULE = "dsx3d.train"
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def is_rank_command(cmdline: list[str]) -> bool:
    """`python [-u] -m dsx3d.train ...`; not the launcher's agent, whose arguments hold `--module dsx3d.train`
    too (a signal to the agent makes it SIGTERM every rank: a second signal, which stops them at once)."""
    return "-m" in cmdline and cmdline[cmdline.index("-m") + 1 :][:1] == [RANK_MODULE]


def rank_processes(launcher_pid: int) -> list[psutil.Process]:
    """The ranks started below the launcher on this node, without processes a rank forked (those share
    its command line)."""
    try:
        below = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks: dict[int, psutil.Process] = {}
    parents: dict[int, int] = {}
    for p in below:
        with contextlib.suppress(psutil.Error):
            if is_rank_command(p.cmdline()):
                ranks[p.pid], parents[p.pid] = p, p.ppid()
    return [p for pid, p in ranks.items() if parents[pid] not in ranks]


class SignalRelay:
    """The owner's handler for RELAYED signals while the launcher (process group `launcher_pid`) runs."""

    def __init__(self, launcher_pid: int, save_on_signal: bool):
        self.launcher_pid, self.save_on_signal = launcher_pid, save_on_signal
        self.received: list[int] = []
        self.first_at: float | None = None
        self.saving = False
        """The first signal went to the ranks, which save before they stop."""

    def install(self) -> SignalRelay:
        for sig in RELAYED:
            signal.signal(sig, self)
        return self

    def __call__(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            self.first_at = time.monotonic()
        if self.save_on_signal and len(self.received) == 1:
            ranks = rank_processes(self.launcher_pid)
            if ranks:
                forwarded = signum if signum != signal.SIGHUP else signal.SIGTERM
                for p in ranks:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(forwarded)
                self.saving = True
                print(
                    f"dsx3d train: {signal.Signals(signum).name}: every rank finishes its step, saves a checkpoint "
                    "and stops (a second signal stops at once)",
                    file=sys.stderr,
                    flush=True,
                )
                return
        self.stop_now()

    def stop_now(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.launcher_pid, signal.SIGTERM)

    def outcome(self, code: int) -> tuple[str, int] | None:
        """(message, exit code) once the launcher ended after a signal; None when no signal arrived."""
        if not self.received:
            return None
        name = signal.Signals(self.received[0]).name
        took = f" {time.monotonic() - self.first_at:.1f} s after the signal" if self.first_at is not None else ""
        if code == 0:  # the signal came after the last step's work had begun: nothing was left to stop
            return f"dsx3d train: {name} arrived as the job finished; it completed every step{took}", 0
        if self.saving and len(self.received) == 1 and code == 128 + self._forwarded():
            return f"dsx3d train: stopped ({name}){took}, after saving a checkpoint (named above)", 128 + self.received[0]
        return f"dsx3d train: stopped ({name}){took}; launcher exit code {code}", 128 + self.received[0]

    def _forwarded(self) -> int:
        first = self.received[0]
        return int(signal.SIGTERM if first == signal.SIGHUP else first)


def group_processes(pgid: int) -> list[psutil.Process]:
    """The processes of process group `pgid` (the launcher's session: its agent and the ranks)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and p.pid != os.getpid():
                found.append(p)
    return found


def end_orphaned_job(launcher_pid: int, code: int, grace_s: float) -> None:
    """The launcher died of a signal while its ranks run on (its per-node agent does not watch it): the
    ranks get a SIGTERM, so with train.save_on_signal they finish their step and save; whatever of the
    group is left after `grace_s` is killed."""
    sig = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    print(
        f"dsx3d train: the deepspeed launcher (pid {launcher_pid}) was killed by {sig}; stopping its ranks "
        "(with train.save_on_signal each finishes its step and saves a checkpoint)",
        file=sys.stderr,
        flush=True,
    )
    for p in group_processes(launcher_pid):
        with contextlib.suppress(psutil.Error):
            if is_rank_command(p.cmdline()):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := group_processes(launcher_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(launcher_pid, signal.SIGKILL)


class StoppedRankReaper:
    """Ends a stopped rank (SIGSTOP, a job-control stop) once another rank of the job has ended.

    A peer names a stopped rank as hung and exits (dsx3d.run.lifeline); the launcher's agent then SIGTERMs
    the ranks and waits 30 s before its SIGKILL, because a stopped process holds the SIGTERM pending. The
    owner sees the same thing sooner: a rank has ended while another one is stopped. It SIGKILLs that one
    after it has been seen stopped twice in a row, so the job ends within a poll or two of the naming. Only
    ranks on this node are seen; a stopped rank elsewhere waits for its own node's agent."""

    def __init__(self, launcher_pid: int):
        self.launcher_pid = launcher_pid
        self.seen: set[int] = set()
        self.stopped_before: set[int] = set()

    def poll(self) -> list[int]:
        """One look at the ranks; the pids it killed."""
        states: dict[int, str] = {}
        for p in rank_processes(self.launcher_pid):
            with contextlib.suppress(psutil.Error):
                states[p.pid] = p.status()
        to_kill = stopped_to_end(self.seen, states, self.stopped_before)
        self.seen |= set(states)
        self.stopped_before = {pid for pid, s in states.items() if s == psutil.STATUS_STOPPED}
        for pid in to_kill:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                print(
                    f"dsx3d train: rank process {pid} is stopped and another rank has ended; killing it so the "
                    "job ends now (its peer named it above)",
                    file=sys.stderr,
                    flush=True,
                )
        return to_kill


def stopped_to_end(seen: set[int], states: dict[int, str], stopped_before: set[int]) -> list[int]:
    """The ranks to kill: stopped now and at the previous look, while a rank seen before has ended."""
    if not seen - set(states):  # no rank has ended
        return []
    return sorted(pid for pid, s in states.items() if s == psutil.STATUS_STOPPED and pid in stopped_before)
