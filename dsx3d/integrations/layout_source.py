"""Where the Trainer drop-in finds its layout, and whether `TrainingArguments` agree with it.

The layout comes from `TrainingArguments.deepspeed` (a JSON written by `dsx3d config`, the same as a dict, or
a recipe YAML) or, under `accelerate launch`, from `ACCELERATE_DEEPSPEED_CONFIG_FILE`. A JSON carries the layout
in its "dsx3d" section and the batch arithmetic at its top level; it is turned back into the recipe it came
from, so the engine is built by the same `build_engine` as `dsx3d train`. Everything here is a pure function
of values, except `install_recipe_paths`, which lets transformers accept a recipe path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from dsx3d.errors import Problem, UserError
from dsx3d.recipe import Recipe, load_recipe, recipe_from_dict

ACCELERATE_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
RECIPE_SUFFIXES = (".yaml", ".yml")
SUPPORTED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
SUPPORTED_SAMPLING = ("random", "sequential")


def is_recipe_path(value: object) -> bool:
    return isinstance(value, str | Path) and Path(value).suffix.lower() in RECIPE_SUFFIXES


def layout_source(deepspeed: str | dict[str, Any] | None) -> str | dict[str, Any]:
    """`TrainingArguments.deepspeed`, else the config `accelerate launch` names in its environment."""
    if deepspeed:
        return deepspeed
    from_env = os.environ.get(ACCELERATE_CONFIG_ENV)
    if from_env:
        return from_env
    raise UserError.single(
        "TrainingArguments.deepspeed",
        deepspeed,
        f"dsx3d.Trainer needs the 3D layout, and neither TrainingArguments.deepspeed nor {ACCELERATE_CONFIG_ENV} gives one",
        "pass deepspeed='CONFIG.json' (from `dsx3d config RECIPE`) or deepspeed='RECIPE.yaml', "
        "or launch with `accelerate launch --config_file FILE.yaml` (from `dsx3d accelerate-config RECIPE`)",
    )


def load_recipe_source(source: str | dict[str, Any], model: dict[str, Any]) -> Recipe:
    """The recipe behind `source`, with its model section replaced by `model` (the Trainer's model rules)."""
    if isinstance(source, dict):
        recipe = recipe_from_ds_config(source, "TrainingArguments.deepspeed", model)
    elif is_recipe_path(source):
        recipe = load_recipe(source)
        recipe = recipe_from_dict({**recipe.model_dump(mode="json"), "model": model}, source=str(source))
    else:
        recipe = recipe_from_ds_config(_read_json(source), str(source), model)
    return recipe


def _read_json(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError.single(
            "TrainingArguments.deepspeed",
            path,
            "file not found",
            "pass the JSON written by `dsx3d config RECIPE`",
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise UserError.single(
            "TrainingArguments.deepspeed",
            path,
            f"not valid JSON ({err})",
            "regenerate it with `dsx3d config RECIPE`",
        ) from None
    if not isinstance(data, dict):
        raise UserError.single(
            "TrainingArguments.deepspeed",
            path,
            "not a JSON object",
            "regenerate it with `dsx3d config RECIPE`",
        )
    return data


def recipe_from_ds_config(config: dict[str, Any], name: str, model: dict[str, Any]) -> Recipe:
    """The recipe a `dsx3d config` JSON came from: layout from its "dsx3d" section, batch arithmetic, clipping
    and ZeRO stage from its top level; every other top-level key travels as a DeepSpeed override, so the
    checker sees (and the engine keeps) whatever the user edited."""
    section = config.get("dsx3d")
    if not isinstance(section, dict):
        raise UserError.single(
            f"{name}: dsx3d",
            None,
            'this DeepSpeed config has no "dsx3d" section, so the 3D layout (dp, tp, pp) is unknown',
            "generate the config with `dsx3d config RECIPE`, or pass the recipe path itself",
        )
    missing = [k for k in ("dp", "tp", "pp", "gpus_per_node", "seq_len", "dtype") if k not in section]
    missing += [
        k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if k not in config
    ]
    if missing:
        raise UserError.single(
            f"{name}",
            missing,
            "required keys are missing",
            "regenerate the config with `dsx3d config RECIPE`",
        )
    zero = config.get("zero_optimization", {})
    data = {
        "model": model,
        "parallel": {
            "dp": section["dp"],
            "tp": section["tp"],
            "pp": section["pp"],
            "stage_layers": section.get("stage_layers"),
            "sequence_parallel": section.get("sequence_parallel", True),
        },
        "cluster": {"nodes": section.get("nodes", 1), "gpus_per_node": section["gpus_per_node"]},
        "train": {
            "micro_batch_size": config["train_micro_batch_size_per_gpu"],
            "gradient_accumulation_steps": config["gradient_accumulation_steps"],
            "seq_len": section["seq_len"],
            "grad_clip": config.get("gradient_clipping", 0.0),
            "dtype": section["dtype"],
            "activation_checkpointing": section.get("activation_checkpointing", False),
        },
        "zero": {"stage": zero.get("stage", 0) if isinstance(zero, dict) else 0},
        "deepspeed": {k: v for k, v in config.items() if k != "dsx3d"},
    }
    return recipe_from_dict(data, source=name)


def model_config_mapping(config: PretrainedConfig) -> dict[str, Any]:
    """An HF config as a recipe's `model.config` mapping."""
    mapping = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    mapping["model_type"] = config.model_type
    return mapping


# -- TrainingArguments against the layout -----------------------------------------------------------------


def precision(args: Any) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def check_training_args(args: Any, recipe: Recipe, world_size: int) -> list[Problem]:
    """Every disagreement between `TrainingArguments` and the layout, and every argument the pipeline cannot
    honour. All of these would otherwise train something other than what one of the two files says."""
    t = recipe.train
    agree = [
        (
            "per_device_train_batch_size",
            args.per_device_train_batch_size,
            "train_micro_batch_size_per_gpu",
            t.micro_batch_size,
            "train.micro_batch_size",
        ),
        (
            "gradient_accumulation_steps",
            args.gradient_accumulation_steps,
            "gradient_accumulation_steps",
            t.gradient_accumulation_steps,
            "train.gradient_accumulation_steps",
        ),
        (
            "max_grad_norm",
            float(args.max_grad_norm),
            "gradient_clipping",
            float(t.grad_clip),
            "train.grad_clip",
        ),
        ("bf16/fp16", precision(args), "dsx3d.dtype", t.dtype, "train.dtype"),
        (
            "activation_checkpointing",
            bool(args.activation_checkpointing),
            "dsx3d.activation_checkpointing",
            t.activation_checkpointing,
            "train.activation_checkpointing",
        ),
    ]
    problems = [
        Problem(
            f"TrainingArguments.{hf_key}",
            hf_value,
            f"disagrees with the layout's {ds_key} = {ds_value!r}",
            f"set {hf_key} to {ds_value!r}, or change {recipe_key} in the recipe and regenerate the config (`dsx3d config`)",
        )
        for hf_key, hf_value, ds_key, ds_value, recipe_key in agree
        if hf_value != ds_value
    ]
    layout = recipe.layout(world_size)
    if layout.world_size != world_size:
        problems.append(
            Problem(
                "WORLD_SIZE",
                world_size,
                f"the job has {world_size} processes but the layout's dp x tp x pp = {layout.dp} x {layout.tp} x {layout.pp} = {layout.world_size}",
                f"launch {layout.world_size} processes, or regenerate the config for {world_size}",
            )
        )
    problems += _unsupported_args(args)
    return problems


def _unsupported_args(args: Any) -> list[Problem]:
    optim = str(getattr(args.optim, "value", args.optim))
    unsupported = [
        (
            "optim",
            optim,
            optim not in SUPPORTED_OPTIMIZERS,
            "the engine's optimizer is torch AdamW",
            f"use one of {list(SUPPORTED_OPTIMIZERS)}",
        ),
        (
            "label_smoothing_factor",
            args.label_smoothing_factor,
            args.label_smoothing_factor != 0,
            "the pipeline's loss is plain cross-entropy",
            "set it to 0",
        ),
        (
            "neftune_noise_alpha",
            args.neftune_noise_alpha,
            args.neftune_noise_alpha is not None,
            "NEFTune hooks the HF model's embedding, which the pipeline does not run",
            "unset it",
        ),
        (
            "use_liger_kernel",
            args.use_liger_kernel,
            bool(args.use_liger_kernel),
            "Liger patches the HF model, which the pipeline does not run",
            "set it to False",
        ),
        (
            "torch_compile",
            args.torch_compile,
            bool(args.torch_compile),
            "the pipeline stages are not compiled",
            "set it to False",
        ),
        (
            "auto_find_batch_size",
            args.auto_find_batch_size,
            bool(args.auto_find_batch_size),
            "the micro-batch size is part of the layout",
            "set it to False",
        ),
        (
            "train_sampling_strategy",
            args.train_sampling_strategy,
            args.train_sampling_strategy not in SUPPORTED_SAMPLING,
            "dsx3d shards data itself",
            f"use one of {list(SUPPORTED_SAMPLING)}",
        ),
        (
            "bf16_full_eval/fp16_full_eval",
            True,
            bool(args.bf16_full_eval or args.fp16_full_eval),
            "evaluation runs in the training dtype",
            "set both to False",
        ),
    ]
    return [
        Problem(f"TrainingArguments.{key}", value, f"not supported by dsx3d.Trainer: {why}", fix)
        for key, value, bad, why, fix in unsupported
        if bad
    ]


# -- TrainingArguments(deepspeed="recipe.yaml") -----------------------------------------------------------


def ds_config_of_recipe(path: str | Path) -> dict[str, Any]:
    """The DeepSpeed config a recipe generates for this job's world size (WORLD_SIZE, else the cluster's)."""
    from dsx3d.checker import check_recipe, raise_for_errors
    from dsx3d.ds_config import build_ds_config

    recipe = load_recipe(path)
    world = int(os.environ.get("WORLD_SIZE", recipe.cluster_world_size))
    raise_for_errors(check_recipe(recipe, world_size=world))
    return build_ds_config(recipe, world)


def install_recipe_paths() -> None:
    """Let `TrainingArguments(deepspeed="recipe.yaml")` through. transformers parses `deepspeed` as DeepSpeed
    JSON while the arguments are built, before any Trainer exists, and fails on YAML; from here on a recipe
    path is read as the config it generates. Only .yaml/.yml paths change behaviour."""
    from transformers.integrations import deepspeed as hf_deepspeed

    cls: Any = hf_deepspeed.HfTrainerDeepSpeedConfig
    if getattr(cls, "_dsx3d_recipe_paths", False):
        return
    original = cls.__init__

    def __init__(self: Any, config_file_or_dict: Any) -> None:
        if is_recipe_path(config_file_or_dict):
            config_file_or_dict = ds_config_of_recipe(config_file_or_dict)
        original(self, config_file_or_dict)

    cls.__init__ = __init__
    cls._dsx3d_recipe_paths = True
