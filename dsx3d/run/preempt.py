"""Preemption in a rank: a stop signal ends the job after the step every rank is in, with a checkpoint.

A cluster announces a preemption with a signal (SIGTERM from SLURM or Kubernetes, SIGUSR1 from a batch
script's `--signal`, SIGINT from Ctrl-C through `dsx3d train`). With `train.save_on_signal` each rank
installs a handler that only records the signal; the training loop asks once per step, in one small
all-reduce (`StopRequest.agreed`), whether any rank got one, so every rank stops after the same step, saves
that step's checkpoint and exits with a message naming the signal and the checkpoint.

Stopping at once: a second signal, or `train.signal_deadline_s` passing before the checkpoint is written,
ends the rank immediately (exit 128 + signal). Nothing is lost beyond the steps since the last complete
checkpoint: a checkpoint becomes `latest` only once every file of it is written and listed in its manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("dsx3d")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_at_once(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class StopRequest:
    """The first stop signal this rank received (`signum`), and the agreement of all ranks on it.

    `ckpt_dir` names the checkpoints directory in the message of an immediate stop (the last complete
    checkpoint, which is kept). `exit_now` ends the process (tests replace it)."""

    def __init__(
        self,
        deadline_s: float = 0.0,
        ckpt_dir: Path | None = None,
        *,
        loud: bool = True,
        exit_now: Callable[[int], None] = _exit_at_once,
    ):
        self.deadline_s, self.ckpt_dir, self.loud, self._exit_now = deadline_s, ckpt_dir, loud, exit_now
        self.signum: int | None = None
        self.received_at: float | None = None
        self.stopped_at: int | None = None
        """The step after which the ranks agreed to stop (set by the training loop)."""
        self.agreed_signal: int | None = None
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    # --- in the rank's main thread ------------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self, signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
        """Handle `signals` for the duration of the block (the previous handlers come back after it)."""
        self.install(signals)
        try:
            yield self
        finally:
            self.cancel()
            for s, handler in self._previous.items():
                with contextlib.suppress(TypeError, ValueError):
                    signal.signal(s, handler)  # type: ignore[arg-type]
            self._previous.clear()

    def install(self, signals: tuple[int, ...] = STOP_SIGNALS) -> StopRequest:
        """Handle `signals` from now on (the main thread only: Python runs handlers there)."""
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.request(signum)

    def request(self, signum: int, cause: str = "") -> None:
        """A stop signal arrived: the first asks for a save; a second one stops at once. `cause` says why when
        it is not a signal received (a launcher that ended)."""
        if self.stopped_at is not None:  # saved and on the way out (the launcher ends the slower ranks)
            # said by this rank too: the peer that would have said it may be the one this signal ends first
            self._end_after_save(f"{signal_name(signum)} ended this rank", self.agreed_signal or signum)
            return
        if self.signum is not None:
            self.stop_now(f"a second signal ({signal_name(signum)})", signum)
            return
        self.signum, self.received_at = signum, time.monotonic()
        if self.loud:
            log.warning(
                "%s: finishing this step, then saving a checkpoint and stopping (a second signal stops at once)",
                cause or f"{signal_name(signum)} received",
            )
        if self.deadline_s > 0:
            self._timer = threading.Timer(
                self.deadline_s,
                self.stop_now,
                args=(f"train.signal_deadline_s = {self.deadline_s:g} s passed since {signal_name(signum)}", signum),
            )
            self._timer.daemon = True
            self._timer.start()

    def peer_ended(self, what: str) -> None:
        """A peer ended (`what`: the message naming it) while this rank was stopping: the stop is the cause,
        and this rank says so itself and exits 128 + the signal (with no stop under way it returns). A second
        signal sent to every rank can end a peer first while this rank's main thread waits in a collective,
        where Python cannot run this rank's handler: the peer's end is then all this rank sees of the signal."""
        if self.stopped_at is not None:
            self._end_after_save(what, self.agreed_signal or self.signum or signal.SIGTERM)
        elif self.signum is not None:
            self.stop_now(f"{what}, after {signal_name(self.signum)} asked for a stop (a second signal ends a rank at once)",
                          self.signum, loud=True)

    def _end_after_save(self, cause: str, signum: int) -> None:
        """End this rank after the stop's checkpoint is complete, saying the stop (`cause`: what ended it)."""
        log.warning(
            "stopped by %s after step %d: its checkpoint is saved (%s on the way out)",
            signal_name(signum), self.stopped_at, cause,
        )
        self._exit_now(128 + signum)

    def stop_now(self, why: str, signum: int, *, loud: bool | None = None) -> None:
        """End this rank immediately; `latest` still names the last complete checkpoint."""
        if self.loud if loud is None else loud:
            kept = self._last_complete()
            log.error(
                "%s: stopping at once without a new checkpoint; %s", why,
                f"the last complete checkpoint {kept} is kept (resume with --resume)"
                if kept
                else "the checkpoints saved so far are kept",
            )
        self._exit_now(128 + signum)

    def _last_complete(self) -> str | None:
        if self.ckpt_dir is None:
            return None
        from dsx3d.checkpoint.training.disk_format import read_latest

        try:
            tag = read_latest(self.ckpt_dir)
        except Exception:  # a damaged `latest` is reported by --resume; here only the message is at stake
            return None
        return str(self.ckpt_dir / tag) if tag else None

    def cancel(self) -> None:
        """The checkpoint is written (or the run is over): no deadline any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # --- a collective, once per step ---------------------------------------------------------------------

    def agreed(self) -> int:
        """The signal some rank received (the highest number when several did), 0 when none did. Every rank
        calls it after the same step, so all of them stop after the same one."""
        import torch

        from dsx3d.distributed import comm

        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        got = int(comm.all_reduce_max(flag).item())
        if got:
            self.agreed_signal = got
        return got


def preempted_message(signum: int, step: int, checkpoint: Path, recipe_path: str | None = None) -> str:
    resume = f"dsx3d train {recipe_path} --resume" if recipe_path else "--resume"
    return (
        f"stopped by {signal_name(signum)} after step {step}: checkpoint {checkpoint} saved; continue with {resume}"
    )
