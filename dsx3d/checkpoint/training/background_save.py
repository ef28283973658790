"""Asynchronous checkpoint saves (`train.async_save`): the state is copied in the main thread, the files are
written by one background thread per rank while training goes on.

Snapshot. DeepSpeed's `save_checkpoint` runs as usual in the main thread (its barriers and tag check are
collectives), but each state dict it hands its checkpoint engine is copied (`snapshot`: every tensor cloned
into CPU memory) and queued instead of written. The next optimizer step changes the live tensors in place
(weights, ZeRO's fp32 partitions, Adam's moments), never the copies, so the files hold the state of the
step the save was taken at. The copies cost one more copy of the rank's checkpoint state in host memory
until they are written.

Writing. `WriterThread` runs the queued writes; it makes no collective: gloo collectives from a second
thread on the groups the training step uses are not safe. Whatever needs every rank (the exchange of what
failed, rank 0's manifest, the move of `latest`, pruning) runs later in the main thread, when the next save,
the end of the run or a preemption stop joins the thread (dsx3d.checkpoint.training.checkpointer).

Why not DeepSpeed's own decoupled engine (`checkpoint.writer.decoupled`, runtime/checkpoint_engine/
decoupled_checkpoint_engine.py): it commits a save inside `DeepSpeedEngine.step()`, which the pipeline
engine never calls (its optimizer step is `_take_model_step`), so a pipeline's save is never committed; it
hands live state dicts (the ZeRO optimizer's included, which it does not clone) to a spawned process
through torch.multiprocessing, which moves their storage into shared memory in place, so the child writes
tensors the next step is changing; its default FAST writer needs the libaio op; and a failed write ends its
child process instead of being recorded per file. dsx3d also hashes every file as it is written, which a
writer in another process would have to send back.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dsx3d.boundary_types import DSEngine

Write = tuple[Path, Callable[[], Any]]
"""A file to write and the function that writes it (returning (size, digest) when it hashed what it wrote)."""


def snapshot(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of a (nested) state that later training cannot change: tensors cloned into CPU memory, dicts
    (with their attributes, such as a module state dict's `_metadata`), lists and tuples rebuilt, anything
    else deep-copied. A tensor object named twice is cloned once, so it stays one storage in the file; a view
    is cloned alone, not with the whole buffer it views (as DeepSpeed's clone_tensors_for_torch_save does)."""
    memo = {} if memo is None else memo
    key = id(obj)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to("cpu", copy=True)
        if obj.requires_grad:  # torch.save records the flag (ZeRO's fp32 partitions carry it)
            out.requires_grad_(True)
        for name, value in vars(obj).items():  # attributes torch.save pickles with the tensor
            setattr(out, name, snapshot(value, memo))
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # the same mapping type, its attributes copied shallowly, then every value
        for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
            setattr(out, name, copy.deepcopy(value))
        for k, v in obj.items():
            out[k] = snapshot(v, memo)
    elif isinstance(obj, list):
        out = [snapshot(v, memo) for v in obj]
    elif type(obj) is tuple:
        out = tuple(snapshot(v, memo) for v in obj)
    else:  # numbers, strings, torch.Size and other tuples of plain values, enums, dtypes
        out = copy.deepcopy(obj)
    memo[key] = out
    return out


@contextlib.contextmanager
def snapshotting(
    engine: DSEngine, writes: list[Write], write_state: Callable[[Any, Path], Any]
) -> Iterator[None]:
    """Inside the block, DeepSpeed's checkpoint-engine `save(state_dict, path)` appends (path, a write of
    the state's snapshot through `write_state`) to `writes` and returns, and the copy of its recovery
    scripts beside the tags is queued too. Only the main thread calls this."""
    checkpoint_engine = engine.checkpoint_engine
    copy_scripts = engine._copy_recovery_script

    def queue_save(state_dict: object, path: str) -> None:
        taken = snapshot(state_dict)
        writes.append((Path(path), lambda: write_state(taken, Path(path))))

    def queue_copy(save_path: str) -> None:
        writes.append((Path(save_path) / "zero_to_fp32.py", lambda: copy_scripts(save_path)))

    checkpoint_engine.save = queue_save
    # DeepSpeed clones each pipeline layer's state before save() when the engine "preserves storage
    # sharing"; the snapshot clones every tensor anyway, so one copy is enough
    checkpoint_engine.preserves_storage_sharing = lambda: False
    engine._copy_recovery_script = queue_copy
    try:
        yield
    finally:
        for name in ("save", "preserves_storage_sharing"):
            checkpoint_engine.__dict__.pop(name, None)
        engine.__dict__.pop("_copy_recovery_script", None)


class WriterThread:
    """Runs `work` in a daemon thread of this rank. `join` waits for it and returns what it raised, if
    anything; the process can still exit while it runs (a kill leaves a tag without a manifest, which
    `latest` never names)."""

    def __init__(self, name: str, work: Callable[[], None]):
        self.error: BaseException | None = None
        self._work = work
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> WriterThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as err:  # reported where the main thread joins, like a failed write
            self.error = err

    def join(self) -> BaseException | None:
        self._thread.join()
        return self.error
