"""The DeepSpeed JSON of a recipe: batch arithmetic over dp, precision, optimizer, pipeline knobs.

DeepSpeed's world for batch arithmetic is the data-parallel size, so dsx3d writes `train_batch_size`
itself instead of leaving "auto" to transformers or accelerate (which would fill in the whole world).
The layout travels in a top-level "dsx3d" section, which DeepSpeed ignores and accelerate passes along.
It has no "scheduler" section: the recipe's schedule is HF's, built by the engine builder
(dsx3d.recipe.lr_schedule); a `deepspeed.scheduler` in the recipe brings DeepSpeed's own.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import cast

from dsx3d.fsio import write_atomic
from dsx3d.recipe.ds_optimizer import grad_accum_dtype
from dsx3d.recipe.json_values import DSConfig, JSONObject, JSONValue
from dsx3d.recipe.schema import Recipe, TrainSection

# Sections dsx3d never writes: DeepSpeed ignores the first silently; the second turns on AutoTP.
_NEVER_EMIT = ("pipeline_parallel", "tensor_parallel")
STEPS_PER_PRINT = 1_000_000_000  # dsx3d logs itself; keep DeepSpeed's own step log quiet


def build_ds_config(recipe: Recipe, world_size: int | None = None, hidden_size: int | None = None) -> DSConfig:
    """The DeepSpeed config for `recipe` on `world_size` ranks (default: the cluster's), overrides merged;
    their "auto" values resolved from the recipe (`resolve_auto`; `hidden_size` sizes ZeRO's buckets)."""
    layout = recipe.layout(world_size)
    train = recipe.train
    config: DSConfig = {
        # DeepSpeed's data axis is dp x cp (context parallelism: each CP rank runs a slice of the same sequences)
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * layout.data_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "gradient_clipping": train.grad_clip,
        "steps_per_print": STEPS_PER_PRINT,
        "zero_optimization": {"stage": recipe.zero.stage},
        "bf16": {"enabled": train.dtype == "bf16"},
        "fp16": {"enabled": train.dtype == "fp16"},
        "optimizer": _optimizer(train),
        "pipeline": {
            # Stages exchange tuples of tensors; partitioning them over TP ranks only handles one tensor.
            "pipe_partitioned": False,
            "grad_partitioned": False,
            # Re-entrant checkpointing fails on the embedding's integer input.
            "use_reentrant": False,
            "activation_checkpoint_interval": 1 if train.activation_checkpointing else 0,
        },
        "dsx3d": {
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "ep": layout.ep,
            "cp": layout.cp,
            "nodes": layout.num_nodes,
            "gpus_per_node": layout.gpus_per_node,
            "world_size": layout.world_size,
            "stage_layers": cast("list[JSONValue] | None", recipe.parallel.stage_layers),
            "sequence_parallel": recipe.parallel.sequence_parallel,
            "seq_len": train.seq_len,
            "activation_checkpointing": train.activation_checkpointing,
            "dtype": train.dtype,
        },
    }
    accum = grad_accum_dtype(train.dtype, recipe.zero.stage)
    if accum is not None:
        # Accumulate bf16 gradients in fp32. Without ZeRO DeepSpeed rejects this mix (NotImplementedError).
        config["data_types"] = {"grad_accum_dtype": accum}
        # and reduce them over dp in fp32: DeepSpeed's default for bf16 is bf16 reductions, which round each
        # micro-batch's sum over the DP ranks to 8 bits before it reaches the fp32 accumulator (ZeRO-2/3)
        config["communication_data_type"] = "fp32"
    return merge_overrides(config, resolve_auto(recipe.deepspeed, config, recipe.train, hidden_size))


def merge_overrides(config: DSConfig, overrides: DSConfig) -> DSConfig:
    """`overrides` merged into a generated `config` (inputs untouched); an optimizer or schedule of another
    type than the generated one brings its own parameters, not a mix with dsx3d's. A top-level override of
    None removes that section (`"scheduler": None`: no LR scheduler in the engine at all)."""
    config = dict(config)
    for section in ("optimizer", "scheduler"):
        given, ours = overrides.get(section), config.get(section)
        if isinstance(given, dict) and isinstance(ours, dict) and given.get("type", ours.get("type")) != ours.get("type"):
            config.pop(section)
    merged = deep_merge(config, overrides)
    for key in _NEVER_EMIT:
        merged.pop(key, None)
    return {k: v for k, v in merged.items() if v is not None}


AUTO = "auto"


def _recipe_values(train: TrainSection) -> JSONObject:
    """What an "auto" under optimizer.params / scheduler.params means, by key, as HF's Trainer fills them."""
    return {
        "lr": train.lr,
        "betas": list(train.betas),
        "eps": train.eps,
        "weight_decay": train.weight_decay,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": train.lr,
        "warmup_num_steps": train.warmup_steps,
        "total_num_steps": train.steps,
        "warmup_min_ratio": 0.0,
        "cos_min_ratio": train.min_lr / train.lr,
    }


def resolve_auto(
    overrides: DSConfig, generated: DSConfig, train: TrainSection, hidden_size: int | None = None
) -> DSConfig:
    """`overrides` with each "auto" (the form HF's example DeepSpeed JSONs ship) replaced by what dsx3d
    derives from the recipe: the generated value at the same path (batch sizes, precision, clipping,
    optimizer and scheduler parameters), optimizer/scheduler parameters by name, and ZeRO's bucket sizes
    from the hidden size h (HF's formulas: h^2, 0.9 h^2, 10 h). Anything else stays "auto": the checker
    reports it (`auto_paths`)."""
    by_name = _recipe_values(train)
    zero_auto = {} if hidden_size is None else {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }

    def walk(value: JSONValue, gen: JSONValue, path: tuple[str, ...]) -> JSONValue:
        if isinstance(value, dict):
            return {k: walk(v, gen.get(k) if isinstance(gen, dict) else None, (*path, k)) for k, v in value.items()}
        if value != AUTO:
            return value
        if gen is not None and gen != AUTO:
            return copy.deepcopy(gen)
        if len(path) == 3 and path[0] in ("optimizer", "scheduler") and path[1] == "params" and path[2] in by_name:
            return by_name[path[2]]
        if len(path) == 2 and path[0] == "zero_optimization" and path[1] in zero_auto:
            return zero_auto[path[1]]
        return value

    return cast(DSConfig, walk(overrides, generated, ()))  # a mapping walks to a mapping


def auto_paths(config: JSONValue, prefix: str = "") -> list[str]:
    """Dotted paths of the values still "auto" in a config."""
    if isinstance(config, dict):
        return [p for k, v in config.items() for p in auto_paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if config == AUTO else []


def _optimizer(train: TrainSection) -> JSONObject:
    return {
        "type": "AdamW",
        "params": {
            "lr": train.lr,
            "betas": list(train.betas),
            "eps": train.eps,
            "weight_decay": train.weight_decay,
            "torch_adam": True,  # no fused-op build on CPU
            "adam_w_mode": True,
        },
    }


def deep_merge(base: DSConfig, overrides: DSConfig) -> DSConfig:
    """`base` with `overrides` on top: mappings merge key by key, anything else replaces. Inputs untouched."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(cast(DSConfig, out[key]), value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render_ds_config(config: DSConfig) -> str:
    """The canonical text of a config: stable key order, so regenerated files diff cleanly."""
    return json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_ds_config(recipe: Recipe, path: str | Path, world_size: int | None = None) -> Path:
    """Write the config atomically and readable by others (the launcher, accelerate, colleagues)."""
    return write_atomic(path, render_ds_config(build_ds_config(recipe, world_size)))
