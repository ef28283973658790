"""Checks of the DeepSpeed section: batch and precision overrides, contradictions, values left on auto, timers, and overrides that replace what dsx3d generates (the schedule included)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dsx3d.checks.context import _Context, _warning
from dsx3d.errors import Problem
from dsx3d.recipe.ds_config import AUTO, auto_paths, build_ds_config


def _batch_overrides(c: _Context) -> Iterator[Problem]:
    """accelerate's and transformers' "auto" fill train_batch_size with the world size; with a pipeline
    DeepSpeed divides by dp instead and fails at start-up, so dsx3d owns these three keys."""
    train, cp = c.recipe.train, c.recipe.parallel.cp
    m, g = train.micro_batch_size, train.gradient_accumulation_steps
    data = c.dp * cp  # DeepSpeed's data-parallel ranks: the CP ranks of each DP rank count among them
    data_key = "dp x cp" if cp > 1 else "dp"
    owners = {
        "train_micro_batch_size_per_gpu": ("train.micro_batch_size", m),
        "gradient_accumulation_steps": ("train.gradient_accumulation_steps", g),
        "train_batch_size": (f"train.micro_batch_size x train.gradient_accumulation_steps x {data_key}", m * g * data),
    }
    for key, (source, want) in owners.items():
        if (
            key not in c.overrides
            or c.overrides[key] in (want, AUTO)
            or (key == "train_batch_size" and not c.dp)
        ):
            continue
        yield Problem(
            f"deepspeed.{key}",
            c.overrides[key],
            f"disagrees with {source} = {want} (train_batch_size must be {m} x {g} x {data}: DeepSpeed's "
            f"world for batch arithmetic is the data-parallel size {data_key} = {data}, not the world size {c.world_size})",
            f"remove deepspeed.{key}; set train.micro_batch_size and train.gradient_accumulation_steps instead",
        )


def _grad_accum_dtype(c: _Context) -> Iterator[Problem]:
    if c.recipe.train.dtype != "bf16" or c.pp == 1:
        return
    data_types = c.overrides.get("data_types")
    accum = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    if accum not in (None, "fp32"):
        yield Problem(
            "deepspeed.data_types.grad_accum_dtype",
            accum,
            "a bf16 pipeline must accumulate gradients in fp32; bf16 accumulation over many micro-batches loses precision",
            "remove the override (dsx3d sets fp32)",
        )
    if c.recipe.zero.stage == 0:
        yield _warning(
            "zero.stage",
            0,
            "DeepSpeed cannot combine bf16 weights with fp32 gradient accumulation without ZeRO, so this "
            "pipeline would accumulate its gradients in bf16",
            "set zero.stage: 1",
        )


def _contradicting_overrides(c: _Context) -> Iterator[Problem]:
    o = c.overrides
    if "pipeline_parallel" in o:
        yield Problem(
            "deepspeed.pipeline_parallel",
            o["pipeline_parallel"],
            "DeepSpeed silently ignores this section; the pipeline comes from the model wrapping",
            "remove it and set parallel.pp (and parallel.stage_layers)",
        )
    if "tensor_parallel" in o:
        yield Problem(
            "deepspeed.tensor_parallel",
            o["tensor_parallel"],
            "this enables DeepSpeed's AutoTP, which has no pipeline support and would shard the model a second time",
            "remove it and set parallel.tp",
        )
    zero = o.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage", AUTO) not in (AUTO, c.recipe.zero.stage):
        yield Problem(
            "deepspeed.zero_optimization.stage",
            zero["stage"],
            f"contradicts zero.stage = {c.recipe.zero.stage}",
            "remove the override and set zero.stage",
        )
    for section in ("bf16", "fp16"):
        enabled = o.get(section, {}).get("enabled") if isinstance(o.get(section), dict) else None
        if enabled not in (None, AUTO) and bool(enabled) != (c.recipe.train.dtype == section):
            yield Problem(
                f"deepspeed.{section}.enabled",
                enabled,
                f"contradicts train.dtype = {c.recipe.train.dtype}",
                "remove the override and set train.dtype",
            )


def _async_save_writer(c: _Context) -> Iterator[Problem]:
    """train.async_save writes every checkpoint file itself, from a copy taken at the step, in a thread of
    each rank (dsx3d.checkpoint.training.background_save): a DeepSpeed checkpoint writer set in the recipe
    would be bypassed without a word, so the two are not combined."""
    if not c.recipe.train.async_save:
        return
    section = c.overrides.get("checkpoint")
    writer = section.get("writer") if isinstance(section, dict) else None
    if writer is not None:
        yield Problem(
            "deepspeed.checkpoint.writer",
            writer,
            "train.async_save writes the checkpoint files itself in a background thread, so DeepSpeed's writer "
            "would never run (and its decoupled writer never commits a pipeline's save)",
            "remove deepspeed.checkpoint.writer, or set train.async_save: false",
        )
    if c.overrides.get("datastates_ckpt", False) is not False:
        yield Problem(
            "deepspeed.datastates_ckpt",
            c.overrides["datastates_ckpt"],
            "train.async_save writes the checkpoint files itself in a background thread, so the DataStates "
            "engine would never run",
            "remove deepspeed.datastates_ckpt, or set train.async_save: false",
        )


def _fp16(c: _Context) -> Iterator[Problem]:
    if c.recipe.train.dtype == "fp16":
        yield _warning(
            "train.dtype",
            "fp16",
            "DeepSpeed refuses fp16 on CPU ('Type fp16 is not supported on your device'); fp16 also needs loss scaling",
            "use bf16 (or fp32 on CPU); keep fp16 only for GPUs without bf16",
        )


def _auto_left(c: _Context) -> Iterator[Problem]:
    """ "auto" (the form of HF's example DeepSpeed JSONs) is resolved from the recipe where dsx3d derives the
    value; anywhere else DeepSpeed would compare a string with numbers minutes after launch."""
    if not auto_paths(c.overrides) or not c.dp or c.world_size % (c.tp * c.pp):
        return
    config = build_ds_config(c.recipe, c.world_size, hidden_size=c.dim("hidden_size"))
    for path in auto_paths(config):
        yield Problem(
            f"deepspeed.{path}",
            AUTO,
            'dsx3d resolves "auto" only where it derives the value from the recipe (batch sizes, precision, '
            "clipping, AdamW and schedule parameters, ZeRO bucket sizes)",
            "give a number",
        )


def _deepspeed_timers(c: _Context) -> Iterator[Problem]:
    if c.overrides.get("wall_clock_breakdown") and c.pp > 1:
        yield Problem(
            "deepspeed.wall_clock_breakdown",
            c.overrides["wall_clock_breakdown"],
            "DeepSpeed's pipeline engine starts its backward timer twice with it on and every rank fails "
            "('bwd_microstep timer has already been started')",
            "remove it: dsx3d logs step times and tokens/s itself (metrics.jsonl)",
        )


# Where each generated DeepSpeed value comes from, for reporting an override that replaces it. Longest
# matching prefix wins; keys with their own rule above (batch sizes, ZeRO stage, precision) are not repeated.
_OVERRIDE_SOURCES = {
    "gradient_clipping": "train.grad_clip",
    "optimizer.params.lr": "train.lr",
    "optimizer.params.betas": "train.betas",
    "optimizer.params.eps": "train.eps",
    "optimizer.params.weight_decay": "train.weight_decay",
    "optimizer": "dsx3d's AdamW settings from train",
    "pipeline.activation_checkpoint_interval": "train.activation_checkpointing",
    "pipeline": "dsx3d's pipeline settings",
    "dsx3d": "the layout dsx3d records (parallel, cluster, train)",
    "steps_per_print": "dsx3d's own logging",
    "data_types.grad_accum_dtype": "train.dtype (fp32 accumulation for bf16)",
    "communication_data_type": "train.dtype (fp32 gradient reduction for bf16 with ZeRO)",
}


_OWN_RULES = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization.stage",
    "bf16.enabled",
    "fp16.enabled",
    "pipeline_parallel",
    "tensor_parallel",
}


def _shadowed(
    base: dict[str, Any], overrides: dict[str, Any], prefix: str = ""
) -> Iterator[tuple[str, Any, Any]]:
    for key, value in overrides.items():
        path = f"{prefix}{key}"
        if key not in base:
            continue
        if isinstance(value, dict) and isinstance(base[key], dict):
            yield from _shadowed(base[key], value, f"{path}.")
        elif value != base[key] and value != AUTO:  # "auto" takes dsx3d's value
            yield path, value, base[key]


def _shadowing_overrides(c: _Context) -> Iterator[Problem]:
    """Every `deepspeed:` value that replaces one dsx3d generates from the recipe is reported: the recipe
    would otherwise say one thing while DeepSpeed does another."""
    if not c.overrides or not c.dp:
        return
    if c.world_size % (c.tp * c.pp):
        return
    base = build_ds_config(
        c.recipe.model_copy(update={"deepspeed": {}}), c.world_size, hidden_size=c.dim("hidden_size")
    )
    for path, value, generated in _shadowed(base, c.overrides):
        if path in _OWN_RULES:
            continue
        source = next(
            (
                s
                for prefix, s in sorted(_OVERRIDE_SOURCES.items(), key=lambda kv: -len(kv[0]))
                if path == prefix or path.startswith(prefix + ".")
            ),
            "a value dsx3d generates",
        )
        yield _warning(
            f"deepspeed.{path}",
            value,
            f"replaces {generated!r}, which dsx3d derives from {source}; DeepSpeed will use the override",
            f"remove deepspeed.{path} and set {source} instead, if that is what you meant",
        )


def _scheduler_override(c: _Context) -> Iterator[Problem]:
    """The generated config has no scheduler: the engine steps HF's schedule for train.lr_schedule,
    train.warmup_steps, train.steps and train.min_lr (dsx3d.recipe.lr_schedule). A `deepspeed.scheduler`
    section replaces it with DeepSpeed's, whose rates per step are not HF's."""
    given = c.overrides.get("scheduler")
    if given is None:
        return
    kind = given.get("type") if isinstance(given, dict) else given
    yield _warning(
        "deepspeed.scheduler",
        kind,
        "replaces the recipe's schedule (HF's get_scheduler from train.lr_schedule, train.warmup_steps, "
        "train.steps and train.min_lr) with DeepSpeed's own, whose rates per step differ from HF's (its warm-up "
        "repeats the start rate and lasts at least 2 steps)",
        "remove deepspeed.scheduler and set the train.* schedule keys, if that is what you meant",
    )


def _deepspeed_schema(c: _Context) -> Iterator[Problem]:
    """The final DeepSpeed config (dsx3d's, the recipe's `deepspeed:` merged in) through DeepSpeed's own
    parsers (`dsx3d.checks.ds_schema`): a value DeepSpeed refuses is an error here, not in every rank
    after launch. Without a `deepspeed:` section the config is dsx3d's own, valid by construction (the golden
    configs and the DeepSpeed fuzz test it), so DeepSpeed is not imported (the planner checks many layouts)."""
    cp = c.recipe.parallel.cp
    if not c.overrides or not c.dp or c.world_size % (c.tp * c.pp * cp):
        return
    from dsx3d.checks.ds_keys import key_problems, without
    from dsx3d.checks.ds_schema import schema_problems

    try:
        config = build_ds_config(c.recipe, c.world_size, hidden_size=c.dim("hidden_size"))
    except ValueError:
        return  # a layout that cannot be built (e.g. ep not dividing dp): the parallel rules name it
    typed = key_problems(config)  # keys DeepSpeed reads unchecked (dsx3d.checks.ds_key_table); batch keys: `_batch_overrides`
    yield from (p for p in typed if p.key.removeprefix("deepspeed.") not in _OWN_RULES)
    if auto_paths(config):
        return  # `_auto_left` names them; DeepSpeed would refuse the strings
    yield from schema_problems(without(config, typed), c.dp * cp)  # DeepSpeed's data axis is dp x cp
