"""One source of truth for what `TrainingArguments` and the layout (recipe, `dsx3d config` JSON or an HF-style
DeepSpeed JSON) both name.

Each shared value is given in one place and taken by the other: a TrainingArguments field left at its HF default
counts as not given. When both sides give it and disagree, one problem names every key and value involved.
When neither gives it, the layout's default decides the five values the layout fixes (micro-batch,
accumulation, clipping, dtype, activation checkpointing) and HF's default decides the optimizer and schedule.

Values are compared in TrainingArguments' terms, so every value HF accepts can be agreed on. The optimizer's
and the schedule's values are HF's to use (dsx3d.Trainer builds the engine's optimizer from TrainingArguments
and runs HF's own scheduler, DeepSpeed's none): the recipe takes a copy where its own fields can hold it (HF
has schedules, warm-up ratios and ranges the recipe does not), for `dsx3d check` and the logs, and nothing
reads that copy to train. The layout's five values must fit the recipe, which the engine is built from.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dsx3d.boundary_types import HFTrainingArguments
from dsx3d.errors import Problem
from dsx3d.integrations import trainer_optim
from dsx3d.recipe.schema import Recipe, TrainSection

log = logging.getLogger("dsx3d")

Claim = tuple[str, object]
"""(where a value is given, for messages: "r.yaml: train.micro_batch_size", the value)."""

# the recipe's (and DeepSpeed's, through layout_source.DS_SCHEDULERS) schedule names as HF's SchedulerType values
# for the same curve; HF has more, which the recipe cannot name
RECIPE_TO_HF_SCHEDULE = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}
HF_TO_RECIPE_SCHEDULE = {v: k for k, v in RECIPE_TO_HF_SCHEDULE.items()}
SUPPORTED_SAMPLING = ("random", "sequential")


@dataclass(frozen=True)
class Shared:
    """A value both TrainingArguments (as `hf_key`) and the recipe (as train.`field`) name."""

    field: str
    hf_key: str
    layout_decides: bool
    """Whether the layout's default applies when nobody gives the value (else HF's)."""
    read: Callable[[HFTrainingArguments], Any]
    """The HF value in the recipe's terms, or None when left at HF's default."""
    write: Callable[[HFTrainingArguments, Any], None]
    """Set the HF fields to a value in the terms `read` returns."""
    from_layout: Callable[[Any], Any] = lambda v: v
    """A layout claim (in the recipe's terms) in the terms `read` returns."""
    to_recipe: Callable[[Any], Any] = lambda v: v
    """The agreed value as the recipe's train.`field`, or None where the recipe has no such value."""


def _hf_default(name: str) -> object:
    from transformers import TrainingArguments

    f = TrainingArguments.__dataclass_fields__[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]


def _plain(name: str, cast: Callable[[Any], Any] = lambda v: v) -> tuple[Callable[[HFTrainingArguments], Any], Callable[[HFTrainingArguments, Any], None]]:
    def read(args: HFTrainingArguments) -> Any:
        value = getattr(args, name)
        return None if value == _hf_default(name) else cast(value)

    def write(args: HFTrainingArguments, value: object) -> None:
        setattr(args, name, value)

    return read, write


def _read_dtype(args: HFTrainingArguments) -> str | None:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else None  # both False: HF's default (fp32), not given


def _write_dtype(args: HFTrainingArguments, value: str) -> None:
    args.bf16, args.fp16 = value == "bf16", value == "fp16"


def _read_checkpointing(args: HFTrainingArguments) -> bool | None:
    return True if args.activation_checkpointing else None


def _write_checkpointing(args: HFTrainingArguments, value: bool) -> None:
    args.activation_checkpointing = args.gradient_checkpointing = value  # the second is HF's deprecated alias


def _read_betas(args: HFTrainingArguments) -> tuple[float, float] | None:
    betas = (float(args.adam_beta1), float(args.adam_beta2))
    return None if betas == (_hf_default("adam_beta1"), _hf_default("adam_beta2")) else betas


def _write_betas(args: HFTrainingArguments, value: tuple[float, float]) -> None:
    args.adam_beta1, args.adam_beta2 = (float(v) for v in value)


def _read_clip(args: HFTrainingArguments) -> float | None:
    value = args.max_grad_norm  # HF clips only when it is a positive number: None and 0 (or below) do not clip
    return None if value == _hf_default("max_grad_norm") else float(value) if value is not None and value > 0 else 0.0


def _read_schedule(args: HFTrainingArguments) -> str | None:
    """The SchedulerType's value (any of HF's), None when left at HF's default."""
    name = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    return None if name == _hf_default("lr_scheduler_type") else name


def _write_schedule(args: HFTrainingArguments, value: str) -> None:
    from transformers.trainer_utils import SchedulerType

    args.lr_scheduler_type = SchedulerType(value)


def _warmup_to_recipe(value: float) -> int | None:
    """HF's warm-up (steps, or below 1 a ratio of the training steps) as the recipe's whole steps, if it is one."""
    return int(value) if value >= 1 or value == 0 else None  # HF's get_warmup_steps truncates steps >= 1


SHARED: list[Shared] = [
    Shared("micro_batch_size", "per_device_train_batch_size", True, *_plain("per_device_train_batch_size", int)),
    Shared("gradient_accumulation_steps", "gradient_accumulation_steps", True, *_plain("gradient_accumulation_steps", int)),
    Shared("grad_clip", "max_grad_norm", True, _read_clip, _plain("max_grad_norm")[1]),
    Shared("dtype", "bf16/fp16", True, _read_dtype, _write_dtype),
    Shared("activation_checkpointing", "gradient_checkpointing", True, _read_checkpointing, _write_checkpointing),
    Shared("lr", "learning_rate", False, *_plain("learning_rate", float)),
    Shared("weight_decay", "weight_decay", False, *_plain("weight_decay", float)),
    Shared("betas", "adam_beta1/adam_beta2", False, _read_betas, _write_betas),
    Shared("eps", "adam_epsilon", False, *_plain("adam_epsilon", float)),
    Shared("warmup_steps", "warmup_steps", False, *_plain("warmup_steps"), to_recipe=_warmup_to_recipe),
    Shared("steps", "max_steps", False, *_plain("max_steps", int)),
    Shared("lr_schedule", "lr_scheduler_type", False, _read_schedule, _write_schedule,
           from_layout=lambda v: RECIPE_TO_HF_SCHEDULE.get(v, v), to_recipe=HF_TO_RECIPE_SCHEDULE.get),
    Shared("seed", "seed", False, *_plain("seed", int)),
]


def _same(a: object, b: object) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return bool(a == b)


def reconcile(args: HFTrainingArguments, recipe: Recipe, layout_claims: dict[str, list[Claim]]) -> tuple[Recipe, list[Problem]]:
    """Agree TrainingArguments and the layout on every SHARED value; returns the recipe with the agreed values
    and the disagreements. `args` is updated in place (only when there is no problem)."""
    problems: list[Problem] = []
    agreed: dict[str, object] = {}
    for shared in SHARED:
        claims = [(key, value, shared.from_layout(value)) for key, value in layout_claims.get(shared.field, [])]
        hf_value = shared.read(args)
        if hf_value is not None:
            claims.insert(0, (f"TrainingArguments.{shared.hf_key}", hf_value, hf_value))
        if any(not _same(v, claims[0][2]) for _, _, v in claims[1:]):
            (key, value, _), rest = claims[0], claims[1:]
            problems.append(
                Problem(
                    key,
                    value,
                    "disagrees with " + ", ".join(f"{k} = {v!r}" for k, v, _ in rest),
                    "give the value in one place (the other takes it over) or the same value in each",
                )
            )
        elif claims:
            agreed[shared.field] = claims[0][2]
        elif shared.layout_decides:
            agreed[shared.field] = shared.from_layout(getattr(recipe.train, shared.field))
    if "min_lr" in recipe.train.model_fields_set and recipe.train.min_lr != 0:
        problems.append(
            Problem(
                "train.min_lr",
                recipe.train.min_lr,
                "dsx3d.Trainer runs HF's LR scheduler, which has no such setting for every schedule",
                "remove train.min_lr, and use lr_scheduler_type='cosine_with_min_lr' with lr_scheduler_kwargs={'min_lr': ...}",
            )
        )
    train, misfits = _recipe_train(recipe.train, agreed)
    problems += misfits
    if problems:
        return recipe, problems
    for shared in SHARED:
        if shared.field in agreed:
            if shared.read(args) is None:  # not given in TrainingArguments: say where its value comes from
                where = layout_claims[shared.field][0][0] if layout_claims.get(shared.field) else "the layout's default"
                log.info("dsx3d.Trainer: TrainingArguments.%s = %r, from %s", shared.hf_key, agreed[shared.field], where)
            shared.write(args, agreed[shared.field])
    return recipe.model_copy(update={"train": train}), []


def _recipe_train(train: TrainSection, agreed: dict[str, object]) -> tuple[TrainSection, list[Problem]]:
    """The recipe's train section with the agreed values it can hold. A layout value it cannot hold is a problem
    (the engine is built from it); an optimizer or schedule value stays HF's alone (nothing trains from the copy)."""
    values = train.model_dump()
    problems: list[Problem] = []
    for shared in SHARED:
        if shared.field not in agreed:
            continue
        value = shared.to_recipe(agreed[shared.field])
        if value is None:
            continue
        try:
            TrainSection.model_validate({**values, shared.field: value})
        except ValidationError as err:
            if shared.layout_decides:
                why = "; ".join(e["msg"] for e in err.errors())
                problems.append(Problem(f"TrainingArguments.{shared.hf_key}", agreed[shared.field], f"outside the layout's range ({why})", f"use a value the recipe's train.{shared.field} takes"))
            continue
        values[shared.field] = value
    return TrainSection.model_validate(values), problems


def unsupported_args(args: HFTrainingArguments, dp: int, cp: int) -> list[Problem]:
    """TrainingArguments dsx3d.Trainer cannot honour at `dp` data-parallel and `cp` context-parallel ranks; each
    would otherwise be ignored or train differently."""
    optim = str(getattr(args.optim, "value", args.optim))
    optim_refusal = trainer_optim.refusal_reason(args)
    include = [str(getattr(v, "value", v)) for v in (args.include_for_metrics or [])]
    unsupported = [
        ("optim", optim, optim_refusal is not None, optim_refusal, f"use one of {trainer_optim.supported()}"),
        # HF's LabelSmoother runs on vocab shards (dsx3d.integrations.label_smoothing), not on CP slices
        ("label_smoothing_factor", args.label_smoothing_factor, cp > 1 and args.label_smoothing_factor != 0,
         f"at parallel.cp = {cp} the loss is computed on slices of each sequence, which label smoothing does not take",
         "set it to 0, or set parallel.cp: 1"),
        ("neftune_noise_alpha", args.neftune_noise_alpha, args.neftune_noise_alpha is not None,
         "NEFTune hooks the HF model's embedding, which the pipeline does not run", "unset it"),
        ("use_liger_kernel", args.use_liger_kernel, bool(args.use_liger_kernel),
         "Liger patches the HF model, which the pipeline does not run", "set it to False"),
        ("torch_compile", args.torch_compile, bool(args.torch_compile), "the pipeline stages are not compiled", "set it to False"),
        ("auto_find_batch_size", args.auto_find_batch_size, bool(args.auto_find_batch_size),
         "the micro-batch size is part of the layout", "set it to False"),
        ("train_sampling_strategy", args.train_sampling_strategy, args.train_sampling_strategy not in SUPPORTED_SAMPLING,
         "dsx3d shards data itself", f"use one of {list(SUPPORTED_SAMPLING)}"),
        ("bf16_full_eval/fp16_full_eval", True, bool(args.bf16_full_eval or args.fp16_full_eval),
         "evaluation runs in the training dtype", "set both to False"),
        ("activation_checkpointing_kwargs", args.activation_checkpointing_kwargs, bool(args.activation_checkpointing_kwargs),
         "the layout's activation checkpointing recomputes every decoder layer, with no options", "unset it"),
        # at dp = 1 there is one device's tokens to average over: the same run either way
        ("average_tokens_across_devices", args.average_tokens_across_devices, dp > 1 and not args.average_tokens_across_devices,
         f"at dp = {dp} dsx3d weights the loss by the tokens of the whole step over all data-parallel ranks",
         "set it to True (HF's default)"),
        ("batch_eval_metrics", args.batch_eval_metrics, bool(args.batch_eval_metrics),
         "dsx3d.Trainer gathers the predictions of the whole evaluation before compute_metrics", "set it to False"),
        ("include_for_metrics", include, "loss" in include,
         "per-batch losses are not gathered for compute_metrics (predictions, labels and inputs are)", "drop 'loss'"),
    ]  # fmt: skip
    return [
        Problem(f"TrainingArguments.{key}", value, f"not supported by dsx3d.Trainer: {why}", fix)
        for key, value, bad, why, fix in unsupported
        if bad
    ]
