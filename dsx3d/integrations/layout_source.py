"""Where the Trainer drop-in finds its layout: a recipe, and what each source says about the values that
TrainingArguments also name (the "claims" dsx3d.integrations.trainer_args reconciles).

`TrainingArguments.deepspeed` (or, under `accelerate launch`, ACCELERATE_DEEPSPEED_CONFIG_FILE) is one of:
- a recipe YAML path;
- a JSON written by `dsx3d config` (or the same as a dict): the layout (dp, cp, tp, pp, ep) in its "dsx3d" section, the batch arithmetic
  at its top level; it turns back into the recipe it came from;
- any DeepSpeed JSON, such as the "auto"-valued ones HF's examples ship, with a section `"dsx3d": {"recipe":
  "my-recipe.yaml"}` naming the recipe that gives the layout (a relative path is relative to the JSON's folder).
  Its "auto" values are resolved as HF resolves them: the batch arithmetic, clipping and precision from the
  agreed values, the optimizer's from TrainingArguments, the ZeRO bucket sizes from the model's hidden size.
  Its explicit values are claims like the recipe's; the rest of it (ZeRO options, ...) is a DeepSpeed override.
Every form ends in a recipe, so the engine is built by the same `build_engine` as `dsx3d train`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import cast

from dsx3d.boundary_types import DSConfig, HFConfig, JSONObject, JSONValue
from dsx3d.errors import Problem, UserError
from dsx3d.integrations.patches import is_recipe_path
from dsx3d.integrations.trainer_args import Claim
from dsx3d.recipe.ds_config import AUTO, auto_paths, deep_merge, resolve_auto
from dsx3d.recipe.schema import Recipe, load_recipe, recipe_from_dict

ACCELERATE_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
# DeepSpeed's scheduler types and the HF schedule of the same shape (dsx3d.Trainer runs HF's scheduler)
DS_SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
Claims = dict[str, list[Claim]]


def layout_source(deepspeed: str | DSConfig | None) -> str | DSConfig:
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


def load_layout(source: str | DSConfig, model: JSONObject, hidden_size: int | None) -> tuple[Recipe, Claims]:
    """The recipe behind `source` with its model section replaced by `model` (the Trainer's model), and the
    values it gives explicitly, by recipe train field."""
    if is_recipe_path(source):
        return _recipe_file(str(source), model)
    name = "TrainingArguments.deepspeed" if isinstance(source, dict) else str(source)
    config = source if isinstance(source, dict) else _read_json(str(source))
    section = config.get("dsx3d")
    if isinstance(section, dict) and "recipe" in section:
        base = Path(".") if isinstance(source, dict) else Path(str(source)).parent
        return _hf_config_with_recipe(config, name, base / str(section["recipe"]), model, hidden_size)
    return recipe_from_ds_config(config, name, model), _dsx3d_json_claims(config, name)


def _recipe_file(path: str, model: JSONObject) -> tuple[Recipe, Claims]:
    recipe = load_recipe(path)
    explicit = recipe.model_dump(mode="json", exclude_unset=True)  # unset keys stay unset: they are not claims
    recipe = recipe_from_dict({**explicit, "model": model}, source=path)
    claims = {k: [(f"{Path(path).name}: train.{k}", getattr(recipe.train, k))] for k in recipe.train.model_fields_set}
    return recipe, claims


def _read_json(path: str) -> DSConfig:
    p = Path(path)
    fix = "pass the JSON written by `dsx3d config RECIPE`, or a DeepSpeed JSON with a \"dsx3d\": {\"recipe\": ...} section"
    if not p.is_file():
        raise UserError.single("TrainingArguments.deepspeed", path, "file not found", fix)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise UserError.single("TrainingArguments.deepspeed", path, f"not valid JSON ({err})", fix) from None
    if not isinstance(data, dict):
        raise UserError.single("TrainingArguments.deepspeed", path, "not a JSON object", fix)
    return data


def recipe_from_ds_config(config: DSConfig, name: str, model: JSONObject) -> Recipe:
    """The recipe a `dsx3d config` JSON came from: layout from its "dsx3d" section, batch arithmetic, clipping
    and ZeRO stage from its top level; every other top-level key travels as a DeepSpeed override, so the
    checker sees (and the engine keeps) whatever the user edited."""
    section = config.get("dsx3d")
    if not isinstance(section, dict):
        raise UserError.single(
            f"{name}: dsx3d",
            None,
            'this DeepSpeed config has no "dsx3d" section, so the 3D layout (dp, tp, pp) is unknown',
            'generate the config with `dsx3d config RECIPE`, pass the recipe path itself, or add "dsx3d": '
            '{"recipe": "RECIPE.yaml"} to this JSON (its "auto" values are then resolved from the recipe)',
        )
    missing = [k for k in ("dp", "tp", "pp", "gpus_per_node", "seq_len", "dtype") if k not in section]
    missing += [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if k not in config]
    if missing:
        raise UserError.single(f"{name}", missing, "required keys are missing", "regenerate the config with `dsx3d config RECIPE`")
    zero = config.get("zero_optimization", {})
    data = {
        "model": model,
        "parallel": {
            "dp": section["dp"],
            "tp": section["tp"],
            "pp": section["pp"],
            "ep": section.get("ep", 1),
            "cp": section.get("cp", 1),
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


def _dsx3d_json_claims(config: DSConfig, name: str) -> Claims:
    section = cast(JSONObject, config["dsx3d"])  # a mapping: how the caller recognised this JSON
    found = {
        "micro_batch_size": ("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu")),
        "gradient_accumulation_steps": ("gradient_accumulation_steps", config.get("gradient_accumulation_steps")),
        "grad_clip": ("gradient_clipping", config.get("gradient_clipping", 0.0)),
        "dtype": ("dsx3d.dtype", section.get("dtype")),
        "activation_checkpointing": ("dsx3d.activation_checkpointing", section.get("activation_checkpointing", False)),
    }
    where = Path(name).name
    return {field: [(f"{where}: {key}", value)] for field, (key, value) in found.items() if value is not None}


# -- an HF-style DeepSpeed JSON ("auto" values) with the recipe named in its "dsx3d" section ----------------


def _hf_config_with_recipe(
    config: DSConfig, name: str, recipe_path: Path, model: JSONObject, hidden_size: int | None
) -> tuple[Recipe, Claims]:
    recipe, claims = _recipe_file(str(recipe_path), model)
    problems: list[Problem] = []
    overrides = {k: v for k, v in config.items() if k != "dsx3d"}

    def claim(field: str, key: str, value: JSONValue) -> None:
        if value is not None and value != AUTO:
            claims.setdefault(field, []).append((f"{Path(name).name}: {key}", value))

    # the batch arithmetic, clipping and precision: explicit values are claims, "auto" is the agreed value;
    # the generated config writes both, so the JSON's copies go
    claim("micro_batch_size", "train_micro_batch_size_per_gpu", overrides.pop("train_micro_batch_size_per_gpu", None))
    claim("gradient_accumulation_steps", "gradient_accumulation_steps", overrides.pop("gradient_accumulation_steps", None))
    claim("grad_clip", "gradient_clipping", overrides.pop("gradient_clipping", None))
    if overrides.get("train_batch_size") == AUTO:
        del overrides["train_batch_size"]  # dsx3d writes micro x accumulation x dp (HF's "auto" would use the world)
    for dtype in ("bf16", "fp16"):
        sub = overrides.pop(dtype, None)
        if isinstance(sub, dict) and sub.get("enabled") not in (None, AUTO, False):
            claim("dtype", f"{dtype}.enabled", dtype)
        if isinstance(sub, dict) and dtype == "fp16":
            rest = {k: v for k, v in sub.items() if k != "enabled"}
            if rest and claims.get("dtype", [("", None)])[-1][1] == "fp16":
                overrides["fp16"] = rest  # loss-scaling options, kept for an fp16 run
    # the optimizer and schedule are TrainingArguments' (HF's scheduler runs): explicit values are claims
    optimizer = overrides.pop("optimizer", None)
    if isinstance(optimizer, dict):
        kind = str(optimizer.get("type", "AdamW"))
        if kind.lower() not in ("adam", "adamw"):
            problems.append(Problem(f"{name}: optimizer.type", kind, "dsx3d.Trainer trains with AdamW", "use AdamW, or drop the optimizer section"))
        params = cast(JSONObject, optimizer.get("params", {}))
        for field, key in (("lr", "lr"), ("betas", "betas"), ("eps", "eps"), ("weight_decay", "weight_decay")):
            claim(field, f"optimizer.params.{key}", params.get(key))
    scheduler = overrides.pop("scheduler", None)
    if isinstance(scheduler, dict):
        kind = str(scheduler.get("type", ""))
        if kind not in DS_SCHEDULERS:
            problems.append(
                Problem(f"{name}: scheduler.type", kind, "dsx3d.Trainer runs HF's LR scheduler, and this one has no HF equivalent",
                        f"use one of {sorted(DS_SCHEDULERS)} or drop the scheduler section and set TrainingArguments.lr_scheduler_type")
            )  # fmt: skip
        else:
            claim("lr_schedule", "scheduler.type", DS_SCHEDULERS[kind])
        params = cast(JSONObject, scheduler.get("params", {}))
        claim("lr", "scheduler.params.warmup_max_lr", params.get("warmup_max_lr"))
        claim("warmup_steps", "scheduler.params.warmup_num_steps", params.get("warmup_num_steps"))
        claim("steps", "scheduler.params.total_num_steps", params.get("total_num_steps"))
    zero = overrides.get("zero_optimization")
    if isinstance(zero, dict):
        stage = zero.get("stage")
        if stage is not None and stage != AUTO:
            if "stage" in recipe.zero.model_fields_set and recipe.zero.stage != stage:
                problems.append(Problem(f"zero_optimization.stage ({name})", stage, f"disagrees with zero.stage = {recipe.zero.stage} ({recipe_path})",
                                        "give the ZeRO stage in one place, or the same in each"))  # fmt: skip
            recipe = recipe.model_copy(update={"zero": recipe.zero.model_copy(update={"stage": int(cast(int, stage))})})
        if zero.get("stage") == AUTO:
            del zero["stage"]
    # what is left: ZeRO's bucket sizes from the hidden size (HF's formulas), nothing else
    overrides = resolve_auto(overrides, {}, recipe.train, hidden_size)
    problems += [
        Problem(f"{name}: {path}", AUTO, "dsx3d resolves \"auto\" only where HF's Trainer does", "give a number")
        for path in auto_paths(overrides)
    ]
    if problems:
        raise UserError(problems)
    merged = deep_merge(recipe.deepspeed, overrides)
    data = {**recipe.model_dump(mode="json", exclude_unset=True), "deepspeed": merged, "zero": recipe.zero.model_dump()}
    recipe = recipe_from_dict(data, source=str(recipe_path))
    return recipe, claims


def model_config_mapping(config: HFConfig) -> JSONObject:
    """An HF config as a recipe's `model.config` mapping."""
    mapping = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    mapping["model_type"] = config.model_type
    return mapping


def ds_config_of_recipe(path: str | Path) -> DSConfig:
    """The DeepSpeed config a recipe generates for this job's world size (WORLD_SIZE, else the cluster's): what
    `TrainingArguments(deepspeed="recipe.yaml")` hands transformers (dsx3d.integrations.patches)."""
    from dsx3d.checks import check_recipe, raise_for_errors
    from dsx3d.recipe.ds_config import build_ds_config

    recipe = load_recipe(path)
    world = int(os.environ.get("WORLD_SIZE", recipe.cluster_world_size))
    raise_for_errors(check_recipe(recipe, world_size=world, data=False))
    return build_ds_config(recipe, world)
