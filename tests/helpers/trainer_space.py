"""The TrainingArguments space dsx3d.Trainer reads, drawn from transformers' own enums and signatures, and a
runner that trains a list of argument sets with dsx3d.Trainer (every rank) or plain transformers.Trainer (one
process) and returns, per set, the log history or the UserError's text."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from dsx3d.errors import UserError
from tests.helpers.trainer_helpers import eval_set, tiny_llama, train_set, training_args

LR = 2e-3
_GIVEN_BY_TRAINER = ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")


def scheduler_names() -> list[str]:
    from transformers.trainer_utils import SchedulerType

    return [s.value for s in SchedulerType]


def needs_eval(name: str) -> bool:
    """Whether HF's own TrainingArguments refuses this schedule without an eval strategy (it steps on a metric)."""
    from transformers import TrainingArguments

    try:
        TrainingArguments(output_dir="unused", lr_scheduler_type=name, eval_strategy="no", report_to=[])
    except ValueError:
        return True
    return False


def _value_for(param: str, steps: int) -> Any:
    """A value for a scheduler argument, by what its name says it is."""
    if param.endswith("_steps"):
        return max(1, steps // 3)
    if param == "min_lr":
        return 1e-5  # below every learning rate the tests draw
    if param.endswith(("_rate", "_ratio")):
        return 0.1
    return 0.5


def scheduler_kwargs(name: str, steps: int) -> dict[str, Any]:
    """The lr_scheduler_kwargs HF's schedule function requires: its arguments without a default (which the
    Trainer does not pass), and one of those its own check names when called without (cosine_with_min_lr's
    min_lr or min_lr_rate). Derived from transformers.optimization, not listed here."""
    import torch
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, get_scheduler
    from transformers.trainer_utils import SchedulerType

    params = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters
    kwargs = {
        p: _value_for(p, steps)
        for p, spec in params.items()
        if p not in _GIVEN_BY_TRAINER and spec.default is inspect.Parameter.empty and spec.kind is spec.POSITIONAL_OR_KEYWORD
    }
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    try:
        get_scheduler(name, optimizer, num_warmup_steps=1, num_training_steps=steps, scheduler_specific_kwargs=kwargs)
    except ValueError as err:
        named = [p for p in params if p not in _GIVEN_BY_TRAINER and p not in kwargs and p in str(err)]
        assert named, f"{name}: HF's error names no argument to give: {err}"
        kwargs[named[0]] = _value_for(named[0], steps)
    return kwargs


# optional arguments that make an adaptive schedule move within a few steps (its defaults wait 10 evaluations)
MOVING = {"patience": 0, "factor": 0.5, "mode": "max", "min_lr": 1e-5}


def schedule_args(name: str, steps: int) -> dict[str, Any]:
    """TrainingArguments overrides that train schedule `name` for `steps` steps as HF requires."""
    kwargs = scheduler_kwargs(name, steps)
    extra: dict[str, Any] = {}
    if needs_eval(name):  # ReduceLROnPlateau's and GreedyLR's options, moving on the eval loss
        kwargs |= MOVING
        extra = {"eval_strategy": "steps", "eval_steps": 1}
    return {"lr_scheduler_type": name, "lr_scheduler_kwargs": kwargs, **extra}


def run_sets(rank: int, out: Path, sets: list[dict[str, Any]], ds_config: Path | None) -> list[Any]:
    """Train each argument set: with dsx3d.Trainer on the layout `ds_config`, or plain transformers.Trainer
    when it is None. Each result is the log history, or the UserError's text when Trainer(...) refused."""
    import transformers

    import dsx3d

    cls = dsx3d.Trainer if ds_config is not None else transformers.Trainer  # first: it lets deepspeed= name a recipe
    results: list[Any] = []
    for i, overrides in enumerate(sets):
        extra = {"deepspeed": str(ds_config)} if ds_config is not None else {}
        args = training_args(out / f"set{i}", **{"learning_rate": LR, **extra, **overrides})
        try:
            trainer = cls(model=tiny_llama(), args=args, train_dataset=train_set(), eval_dataset=eval_set())
        except UserError as err:
            results.append(str(err))
            continue
        trainer.train()
        results.append(trainer.state.log_history)
    return results
