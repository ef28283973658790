"""The recipe's learning-rate schedule, built by HF's `transformers.get_scheduler`.

train.lr_schedule, train.warmup_steps, train.steps and train.min_lr name one of HF's schedules, so `dsx3d
train` steps the rates `transformers.Trainer` (and `dsx3d.Trainer`) would for the same settings. DeepSpeed
builds the optimizer from the generated config; `deepspeed.initialize(lr_scheduler=...)` then calls
`scheduler_factory` with it and steps the result once per optimizer step. A `deepspeed.scheduler` section in
the recipe replaces this with DeepSpeed's own schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dsx3d.recipe.schema import TrainSection

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LambdaLR

# the recipe's names as HF's SchedulerType values ("constant" in HF ignores the warm-up)
HF_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def hf_schedule(train: TrainSection) -> tuple[str, dict[str, object]]:
    """HF's scheduler name and `scheduler_specific_kwargs` for the recipe: cosine with a floor (train.min_lr
    > 0) is `cosine_with_min_lr`. Linear and constant schedules have no floor in HF (min_lr does not apply)."""
    if train.lr_schedule == "cosine" and train.min_lr > 0:
        return "cosine_with_min_lr", {"min_lr": train.min_lr}
    return HF_SCHEDULES[train.lr_schedule], {}


def scheduler_factory(train: TrainSection) -> Callable[[torch.optim.Optimizer], LambdaLR]:
    """A callable that builds the recipe's schedule over an optimizer (what DeepSpeed's `lr_scheduler=` takes).
    The scheduler is a `LambdaLR`: its state (the step it is at) is saved in and restored from checkpoints."""
    name, kwargs = hf_schedule(train)

    def build(optimizer: torch.optim.Optimizer) -> LambdaLR:
        from transformers import get_scheduler

        return get_scheduler(
            name,
            optimizer,
            num_warmup_steps=train.warmup_steps,
            num_training_steps=train.steps,
            scheduler_specific_kwargs=kwargs,
        )

    return build
