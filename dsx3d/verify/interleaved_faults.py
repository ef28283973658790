"""Deliberate defects in interleaved 1F1B's chunk messages (parallel.schedule: interleaved-1f1b), to show that
`dsx3d verify` catches them: the gradient chunk 1 of rank 0 sends back for micro-batch 0 dropped (zeros), or
chunk 1 of rank 0 taking micro-batches 0 and 1 the other way round on the wrap-around link. Like
`dsx3d.verify.faults`, each is a context manager the fork harness starts the ranks inside."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dsx3d.pipeline import interleaved_schedule as runtime


@contextlib.contextmanager
def _replaced(name: str, make: Any) -> Iterator[None]:
    original = getattr(runtime, name)
    setattr(runtime, name, make(original))
    try:
        yield
    finally:
        setattr(runtime, name, original)


def chunk_gradient_dropped() -> contextlib.AbstractContextManager[None]:
    """Rank 0's chunk 1 sends zeros instead of its input gradient for micro-batch 0: chunk 0 learns nothing from it."""

    def make(original: Any) -> Any:
        def send_grad(engine: Any, buffer_id: int, chunk: int) -> None:
            if engine.stage_id == 0 and chunk == 1 and buffer_id == engine.micro_batches:
                for t in runtime._as_tuple(engine.pipe_buffers["inputs"][buffer_id]):
                    if t.grad is not None:
                        t.grad.zero_()
            original(engine, buffer_id, chunk)

        return send_grad

    return _replaced("send_grad", make)


def micro_batches_swapped() -> contextlib.AbstractContextManager[None]:
    """Rank 0's chunk 1 receives micro-batches 0 and 1 from rank p - 1's chunk 0 and runs them the other way round."""

    def make(original: Any) -> Any:
        def recv_activation(engine: Any, buffer_id: int, chunk: int) -> None:
            m = engine.micro_batches
            if engine.stage_id == 0 and chunk == 1 and buffer_id == m:
                original(engine, m, chunk)
                original(engine, m + 1, chunk)
                buffers = engine.pipe_buffers["inputs"]
                buffers[m], buffers[m + 1] = buffers[m + 1], buffers[m]
            elif not (engine.stage_id == 0 and chunk == 1 and buffer_id == m + 1):
                original(engine, buffer_id, chunk)

        return recv_activation

    return _replaced("recv_activation", make)


INTERLEAVED_FAULTS = {"chunk gradient dropped": chunk_gradient_dropped, "micro-batches swapped between chunks": micro_batches_swapped}
