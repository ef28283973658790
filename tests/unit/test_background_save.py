"""The pieces of asynchronous saves that need no process group: the state snapshot and the writer thread
(dsx3d.checkpoint.training.background_save). The saves themselves: tests/distributed/test_async_checkpoint.py."""

from __future__ import annotations

import collections
import io

import torch

from dsx3d.checkpoint.training.background_save import WriterThread, snapshot


class _Scaler:  # DeepSpeed's loss scaler travels in the optimizer state as an object
    def __init__(self) -> None:
        self.cur_scale = [1.0]


def _state() -> tuple[dict, torch.Tensor, torch.Tensor]:
    flat = torch.arange(8.0)
    master = torch.zeros(4, requires_grad=True)
    weights = collections.OrderedDict(w=flat[2:4], tied=flat[2:4])
    weights._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {
        "module": weights,
        "fp32": [master, master],
        "pair": (flat[:1], 3),
        "scaler": _Scaler(),
        "size": torch.Size([2, 3]),
    }
    return state, flat, master


def test_the_snapshot_keeps_the_values_of_its_moment() -> None:
    """An optimizer step changes the live tensors (and objects) in place after the snapshot; the copy keeps
    the values it was taken with, so a background write of it saves the step it was taken at."""
    state, flat, master = _state()
    taken = snapshot(state)
    with torch.no_grad():
        flat.add_(100.0)
        master.add_(1.0)
    state["scaler"].cur_scale[0] = 2.0
    assert torch.equal(taken["module"]["w"], torch.tensor([2.0, 3.0]))
    assert torch.equal(taken["fp32"][0], torch.zeros(4)) and taken["pair"][0].item() == 0.0
    assert taken["scaler"].cur_scale == [1.0] and taken["size"] == torch.Size([2, 3])


def test_the_snapshot_writes_like_the_state() -> None:
    """What torch.save records survives: the mapping type and its `_metadata`, requires_grad, one storage
    for a tensor named twice; a view is copied alone, not with the buffer it views."""
    state, _, _ = _state()
    taken = snapshot(state)
    assert type(taken["module"]) is collections.OrderedDict and taken["module"]._metadata == {
        "": {"version": 1}
    }
    assert taken["fp32"][0].requires_grad and taken["fp32"][0] is taken["fp32"][1]
    assert taken["module"]["w"].untyped_storage().nbytes() == 2 * 4
    buffer = io.BytesIO()
    torch.save(taken, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded["fp32"][0].requires_grad and loaded["fp32"][0] is loaded["fp32"][1]


def test_the_writer_thread_hands_its_failure_to_the_join() -> None:
    def work() -> None:
        raise RuntimeError("disk went away")

    error = WriterThread("test-writer", work).start().join()
    assert isinstance(error, RuntimeError) and "disk went away" in str(error)
    assert WriterThread("test-writer", lambda: None).start().join() is None
