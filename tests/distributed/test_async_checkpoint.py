"""Asynchronous checkpoint saves (`train.async_save`) on two forked gloo ranks (pp 2, ZeRO-1, fp32).

The files of an async save hold the state of the step it was taken at, even when the next optimizer step
has run before a byte was written; a failed background write is reported by name where the save is
joined, and a rank killed during the write leaves `latest` on the previous complete checkpoint. The resume
of a whole run saved asynchronously is in tests/e2e/test_train_resume.py.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.checkpoint.training.disk_format import read_latest, tag_for
from dsx3d.checkpoint.training.tags import tag_problems
from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.verify.harness import RankFailure, run_ranks
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

WORLD = 2


def make_recipe(out: Path, async_save: bool = True) -> Recipe:
    return recipe_from_dict(
        tiny_recipe_dict(
            parallel={"dp": 1, "tp": 1, "pp": WORLD},
            cluster={"nodes": 1, "gpus_per_node": WORLD},
            train={"async_save": async_save, "keep_checkpoints": 3},
            output_dir=str(out),
        )
    )


def _steps(engine: Any, recipe: Recipe, count: int, seed: int) -> None:
    """`count` optimizer steps on random token ids (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    train = recipe.train
    for _ in range(count):
        ids = [
            torch.randint(0, 512, (train.micro_batch_size, train.seq_len), generator=g)
            for _ in range(train.gradient_accumulation_steps)
        ]
        engine.train_step(iter([(x, x) for x in ids]))


def _patch_writes(before: Any) -> None:
    """Every file DeepSpeed saves goes through the checkpointer's hashing writer: call `before(path)` first."""
    from dsx3d.checkpoint.training import checkpointer

    original = checkpointer.save_hashed

    def save_hashed(save: Any, path: Path) -> Any:
        before(Path(path))
        return original(save, path)

    checkpointer.save_hashed = save_hashed  # a forked child: gone with it


def _snapshot_worker(rank: int, out: str) -> None:
    """Step 1, then the same state saved synchronously (sync/) and asynchronously (async/); the async writes
    are held back until step 2 has changed every weight and optimizer moment; then step 2 saved (sync/)."""
    from dsx3d.checkpoint.training.checkpointer import Checkpointer
    from dsx3d.engine import build_engine

    recipe = make_recipe(Path(out))
    engine = build_engine(recipe)
    _steps(engine, recipe, 1, seed=1)
    sync = Checkpointer(engine, Path(out) / "sync", make_recipe(Path(out), async_save=False), keep=3)
    sync.save(1, {"step": 1})
    later = threading.Event()
    _patch_writes(lambda path: later.wait(120) if "/async/" in str(path) else None)
    background = Checkpointer(engine, Path(out) / "async", recipe, keep=3)
    background.save(1, {"step": 1})
    assert read_latest(Path(out) / "async") is None  # nothing is committed before the join
    _steps(engine, recipe, 1, seed=2)
    later.set()
    assert background.wait() == tag_for(1)
    sync.save(2, {"step": 2})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):  # DeepSpeed's loss scaler, pickled as an object
        return type(a) is type(b) and _same(vars(a), vars(b))
    return bool(a == b)


def _torch_files(tag_dir: Path) -> dict[str, Any]:
    return {
        p.relative_to(tag_dir).as_posix(): torch.load(p, weights_only=False) for p in tag_dir.rglob("*.pt")
    }


def test_an_async_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path: Path) -> None:
    """Every torch file of the async tag equals the synchronous save of the same step, although step 2 ran
    before the thread wrote anything; the weights written at step 2 differ (so writing the live tensors
    would have been caught)."""
    run_ranks(_snapshot_worker, WORLD, str(tmp_path), timeout_s=300)
    background, sync = tmp_path / "async" / tag_for(1), tmp_path / "sync" / tag_for(1)
    assert read_latest(tmp_path / "async") == tag_for(1) and tag_problems(background) == []
    written, expected = _torch_files(background), _torch_files(sync)
    assert sorted(written) == sorted(expected) and any(name.startswith("layer_") for name in written)
    for name in expected:
        assert _same(written[name], expected[name]), name
    after = _torch_files(tmp_path / "sync" / tag_for(2))
    layers = [name for name in expected if name.startswith("layer_")]
    assert not any(_same(after[name], expected[name]) for name in layers)


def _failing_worker(rank: int, out: str) -> str:
    """Rank 1 runs out of space half-way through its first file of step 2, in the background thread."""
    from dsx3d.checkpoint.training.checkpointer import Checkpointer, CheckpointNotSaved
    from dsx3d.engine import build_engine

    recipe = make_recipe(Path(out))
    engine = build_engine(recipe)
    ckpt = Checkpointer(engine, Path(out) / "checkpoints", recipe, keep=3)

    def full_disk(path: Path) -> None:
        if rank == 1 and f"/{tag_for(2)}/" in str(path):
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    _patch_writes(full_disk)
    ckpt.save(1, {"step": 1})
    _steps(engine, recipe, 1, seed=1)
    ckpt.save(2, {"step": 2})  # returns: the failure is in the thread
    _steps(engine, recipe, 1, seed=2)
    try:
        ckpt.wait()
    except CheckpointNotSaved as err:
        return str(err)
    return "no error"


def test_a_failed_background_write_is_reported_by_name_where_the_save_is_joined(tmp_path: Path) -> None:
    said = run_ranks(_failing_worker, WORLD, str(tmp_path), timeout_s=300)
    assert said[0] == said[1]  # the same message on every rank
    assert "checkpoint step-000002 was not saved: rank 1: no space left on device" in said[0]
    assert "the previous checkpoint step-000001 is kept" in said[0]
    ckpt = tmp_path / "checkpoints"
    assert read_latest(ckpt) == tag_for(1) and tag_problems(ckpt / tag_for(1)) == []
    assert not (ckpt / tag_for(2)).exists()  # no partial tag


def _dying_worker(rank: int, out: str) -> None:
    """Rank 1 is killed in the middle of its background write of step 2, while training goes on."""
    from dsx3d.checkpoint.training.checkpointer import Checkpointer
    from dsx3d.engine import build_engine

    recipe = make_recipe(Path(out))
    engine = build_engine(recipe)
    ckpt = Checkpointer(engine, Path(out) / "checkpoints", recipe, keep=3)
    _patch_writes(lambda path: os._exit(9) if rank == 1 and f"/{tag_for(2)}/" in str(path) else None)
    ckpt.save(1, {"step": 1})
    _steps(engine, recipe, 1, seed=1)
    ckpt.save(2, {"step": 2})
    _steps(engine, recipe, 2, seed=2)
    ckpt.wait()


def _resume_worker(rank: int, out: str) -> str | None:
    from dsx3d.checkpoint.training.checkpointer import Checkpointer
    from dsx3d.engine import build_engine

    recipe = make_recipe(Path(out))
    loaded = Checkpointer(build_engine(recipe), Path(out) / "checkpoints", recipe, keep=3).load_latest()
    return None if loaded is None else loaded[0]


def test_a_kill_during_a_background_write_leaves_latest_on_the_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RankFailure):
        run_ranks(_dying_worker, WORLD, str(tmp_path), timeout_s=300)
    ckpt = tmp_path / "checkpoints"
    assert read_latest(ckpt) == tag_for(1) and tag_problems(ckpt / tag_for(1)) == []
    assert tag_problems(ckpt / tag_for(2))  # the partial tag is there, without its manifest
    assert run_ranks(_resume_worker, WORLD, str(tmp_path), timeout_s=300) == [tag_for(1)] * WORLD
