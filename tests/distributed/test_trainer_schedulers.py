"""Every `transformers.SchedulerType` trains in dsx3d.Trainer as in plain transformers.Trainer: dsx3d.Trainer
runs HF's own scheduler, so no schedule is refused. One forked run at pp 2 trains every schedule in turn (each
with the lr_scheduler_kwargs HF requires, and an eval strategy where HF requires one); a single process trains
them with plain transformers.Trainer; every step's learning rate and loss, and every evaluation, must match."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import step_values, write_ds_config
from tests.helpers.trainer_space import run_sets, schedule_args, scheduler_names

pytestmark = pytest.mark.usefixtures("warm")

STEPS = 5
TOL = 1e-5


def test_every_hf_scheduler_trains_like_plain_transformers(tmp_path: Path) -> None:
    names = scheduler_names()
    sets = [{"max_steps": STEPS, "warmup_steps": 1, **schedule_args(name, STEPS)} for name in names]
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 1, 2)  # dp 1: the reference takes the same arguments
    ours = run_ranks(run_sets, 2, tmp_path / "ours", sets, ds_config)
    ref = run_ranks(run_sets, 1, tmp_path / "ref", sets, None)[0]
    for name, mine, theirs in zip(names, ours[0], ref, strict=True):
        assert not isinstance(mine, str), f"{name}: refused: {mine}"
        for key, tol in (("learning_rate", 1e-9), ("loss", TOL), ("eval_loss", TOL)):
            a, b = step_values(mine, key), step_values(theirs, key)
            assert len(a) == len(b) == (STEPS if key != "eval_loss" or "eval_strategy" in sets[names.index(name)] else 0), (name, key, a, b)
            assert all(abs(x - y) <= tol for x, y in zip(a, b, strict=True)), (name, key, a, b)
        assert all(step_values(r[names.index(name)], "loss") == step_values(mine, "loss") for r in ours), name
    # the schedules differ: a test that cannot tell them apart would pass a constant rate
    curves = {tuple(step_values(h, "learning_rate")) for h in ref}
    assert len(curves) >= len(names) - 2, curves
