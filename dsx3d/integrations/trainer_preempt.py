"""dsx3d.Trainer's preemption: a stop signal saves a checkpoint through HF's TrainerControl and ends train().

The same contract as `dsx3d train` (dsx3d.run.preempt): the first SIGTERM, SIGINT or SIGUSR1 a rank receives
is only recorded; after every optimizer step the ranks agree (one small all-reduce) whether any rank got
one, and if so every rank sets `control.should_save` and `control.should_training_stop`, so HF writes
`checkpoint-<step>` (model, optimizer, scheduler, RNG, trainer state) and train() returns. A second signal
stops at once. `trainer.preempted` then names the signal and the checkpoint; the script continues with
`trainer.train(resume_from_checkpoint=...)` (or `True`, the newest complete checkpoint in output_dir).
The recipe's `train.signal_deadline_s` and `train.save_on_signal` apply as in `dsx3d train`; a launcher that
ends under the ranks counts as a signal (dsx3d.integrations.trainer_peers).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from dsx3d.run.preempt import StopRequest, signal_name

log = logging.getLogger("dsx3d")


class PreemptionCallback(TrainerCallback):
    """Installs the stop-signal handlers for the duration of train() (main thread only)."""

    def __init__(self, deadline_s: float = 0.0, *, stop: StopRequest | None = None, enabled: bool = True):
        self.deadline_s = deadline_s
        self.enabled = enabled
        """The recipe's train.save_on_signal: False leaves the signals' own handlers (a signal stops at once)."""
        self.stop: StopRequest | None = stop
        self.installed = False
        self.preempted: tuple[int, int, Path] | None = None
        """(signal, step, checkpoint directory) after a stop."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from dsx3d.distributed import comm

        self.preempted = None
        if not self.enabled:
            return
        if self.stop is None:
            self.stop = StopRequest(self.deadline_s, loud=comm.get_rank() == 0)
        if threading.current_thread() is threading.main_thread() and not self.installed:
            self.stop.install()
            self.installed = True

    def launcher_gone(self) -> None:
        """The launcher above this rank has ended (dsx3d.integrations.trainer_peers): stop as on a signal,
        saving a checkpoint after this step, or at once without train.save_on_signal."""
        if self.stop is None:
            from dsx3d.integrations.script_errors import exit_now

            exit_now(1)
        elif self.stop.signum is None and self.preempted is None:  # never a second signal: a stop goes on
            self.stop.request(signal.SIGTERM, cause="the launcher has ended")

    def peer_died(self, message: str) -> None:
        """A peer ended (dsx3d.integrations.trainer_peers): with a stop under way, the stop is said as the cause."""
        if self.stop is not None:
            self.stop.peer_ended(message)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.stop is None:
            return control
        got = self.stop.agreed()
        if got:
            control.should_save = True
            control.should_training_stop = True
            self.preempted = (got, state.global_step, Path(args.output_dir) / f"checkpoint-{state.global_step}")
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The stop's checkpoint is complete (manifest written): said now, so that a signal that ends a rank
        from here on (deepspeed's launcher SIGTERMs the slower ranks) only ends it, and no message is lost.
        A second signal before this point stops at once, saying so."""
        from dsx3d.distributed import comm

        if self.stop is None or self.preempted is None:
            return
        self.stop.stopped_at = state.global_step
        self.stop.cancel()
        if comm.get_rank() == 0:
            signum, step, where = self.preempted
            log.warning(
                "stopped by %s after step %d: checkpoint %s saved; continue with "
                "trainer.train(resume_from_checkpoint=%r)",
                signal_name(signum), step, where, str(where),
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from dsx3d.distributed import comm

        if self.stop is not None:
            self.stop.cancel()
        if self.preempted is not None:
            comm.barrier()  # a script that exits right after train() does not cut rank 0's message short
        self.restore()

    def restore(self) -> None:
        """Give the previous signal handlers back (train() ended), and forget the signal."""
        if self.stop is not None and self.installed:
            for s, handler in self.stop._previous.items():
                signal.signal(s, handler)  # type: ignore[arg-type]
            self.stop._previous.clear()
        self.installed = False
        self.stop = None
