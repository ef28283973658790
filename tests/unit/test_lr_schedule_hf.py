"""The learning rate each optimizer step of `dsx3d train` uses equals HF's `get_scheduler` for the same
(schedule, warm-up, steps, floor): the generated DeepSpeed config carries no scheduler of DeepSpeed's, and the
schedule the engine builder hands `deepspeed.initialize` is stepped once per optimizer step, the rate read
before each step (what `dsx3d train` logs and what the step applies). The real engine's logged rates are
checked in tests/distributed/test_train_one_rank.py."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from dsx3d.recipe.ds_config import build_ds_config
from dsx3d.recipe.lr_schedule import scheduler_factory
from dsx3d.recipe.schema import TrainSection, recipe_from_dict
from tests.helpers.recipes import tiny_recipe_dict

STEPS = 6
LR = 3e-3
SCHEDULES = typing.get_args(TrainSection.model_fields["lr_schedule"].annotation)


def _hf_reference(schedule: str, min_lr: float) -> tuple[str, dict[str, Any]]:
    """HF's scheduler for a recipe schedule, written from HF's SchedulerType (its "constant" has no warm-up)."""
    from transformers import SchedulerType

    if schedule == "cosine" and min_lr:
        return SchedulerType.COSINE_WITH_MIN_LR.value, {"min_lr": min_lr}
    name = {"constant": SchedulerType.CONSTANT_WITH_WARMUP, "linear": SchedulerType.LINEAR, "cosine": SchedulerType.COSINE}
    return name[schedule].value, {}


def _used_lrs(make: Any) -> list[float]:
    import torch

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler, out = make(opt), []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


CASES = [(s, w, 0.0) for s in SCHEDULES for w in (0, 1, 2, 3)] + [("cosine", w, 3e-4) for w in (0, 2)]


@pytest.mark.parametrize(("schedule", "warmup", "min_lr"), CASES, ids=[f"{s}-warmup{w}-min{m:g}" for s, w, m in CASES])
def test_dsx3d_train_lr_per_step_is_hf_schedule(schedule: str, warmup: int, min_lr: float) -> None:
    from transformers import get_scheduler

    train = {"lr": LR, "min_lr": min_lr, "warmup_steps": warmup, "lr_schedule": schedule, "steps": STEPS}
    recipe = recipe_from_dict(tiny_recipe_dict(train=train))
    assert "scheduler" not in build_ds_config(recipe)  # DeepSpeed builds none of its own
    ours = _used_lrs(scheduler_factory(recipe.train))
    name, kwargs = _hf_reference(schedule, min_lr)
    hf = _used_lrs(lambda opt: get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=STEPS, scheduler_specific_kwargs=kwargs))
    assert ours == pytest.approx(hf, abs=1e-12), (ours, hf)
    if warmup:
        assert ours[0] == 0.0 and ours[warmup] == pytest.approx(LR)  # the peak is used, one step after the start


def test_the_documented_example() -> None:
    """lr 3e-3, one warm-up step, 5 steps, cosine: 0, 3e-3, 2.56e-3, 1.5e-3, 4.39e-4."""
    recipe = recipe_from_dict(tiny_recipe_dict(train={"lr": LR, "warmup_steps": 1, "lr_schedule": "cosine", "steps": 5}))
    ours = _used_lrs(scheduler_factory(recipe.train))[:5]
    assert ours == pytest.approx([0.0, 3e-3, 2.56066e-3, 1.5e-3, 4.3934e-4], rel=1e-5)
