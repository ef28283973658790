"""Deliberate defects in the zero-bubble schedule's weight passes (parallel.schedule: zb-h1), to show that
`dsx3d verify` catches them: the W pass of one micro-batch dropped, or run twice. Like `dsx3d.verify.faults`,
each is a context manager the fork harness starts the ranks inside."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dsx3d.distributed.tensor_parallel.weight_grad import WeightGradQueue


@contextlib.contextmanager
def _patched_run(times: int) -> Iterator[None]:
    """W of micro-batch 0 runs its queued products `times` times (0: dropped)."""
    original = WeightGradQueue.run

    def run(self: WeightGradQueue, key: int) -> int:
        if key != 0 or times == 1:
            return original(self, key)
        jobs = list(self.pending.get(key, []))
        done = 0
        for _ in range(times):
            self.pending[key] = list(jobs)
            done += original(self, key)
        self.pending.pop(key, None)
        return done

    WeightGradQueue.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        WeightGradQueue.run = original  # type: ignore[method-assign]


def weight_pass_skipped() -> contextlib.AbstractContextManager[None]:
    """The W pass of the first micro-batch adds nothing: its weight gradients are lost."""
    return _patched_run(0)


def weight_pass_twice() -> contextlib.AbstractContextManager[None]:
    """The W pass of the first micro-batch runs twice: its weight gradients count double."""
    return _patched_run(2)


ZB_FAULTS = {"W pass skipped": weight_pass_skipped, "W pass run twice": weight_pass_twice}
