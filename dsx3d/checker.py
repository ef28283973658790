"""The recipe checker: every rule that would otherwise fail late, deep in DeepSpeed, or silently.

`check_recipe` is a pure function of the recipe, a world size and the model's HF config. It runs every rule
and returns every problem at once, so one `dsx3d check` shows all there is to fix. Each rule is a small
function in `RULES`; each problem names the key path, the value, the reason and the fix.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsx3d.ds_config import AUTO, auto_paths, build_ds_config
from dsx3d.errors import Problem, UserError
from dsx3d.hf_config import dimension_problems, load_hf_config
from dsx3d.layout import Layout, bubble_fraction
from dsx3d.models.family import resolve_family  # noqa: E402
from dsx3d.models.shape import model_dim
from dsx3d.recipe import Recipe

log = logging.getLogger("dsx3d")


@dataclass(frozen=True)
class _Context:
    """What the rules look at: the recipe, the resolved world and dp, the HF config (None if unreadable)."""

    recipe: Recipe
    world_size: int
    world_source: str
    dp: int  # 0 when parallel.dp cannot be resolved
    hf_config: Any

    @property
    def tp(self) -> int:
        return self.recipe.parallel.tp

    @property
    def pp(self) -> int:
        return self.recipe.parallel.pp

    @property
    def overrides(self) -> dict[str, Any]:
        return self.recipe.deepspeed

    def dim(self, name: str) -> int | None:
        return None if self.hf_config is None else model_dim(self.hf_config, name)


Rule = Callable[[_Context], Iterator[Problem]]


def _warning(key: str, value: Any, reason: str, fix: str) -> Problem:
    return Problem(key, value, reason, fix, severity="warning")


def _world_size_matches(c: _Context) -> Iterator[Problem]:
    per_replica = c.tp * c.pp
    if c.recipe.parallel.dp == "auto":
        if c.world_size % per_replica:
            yield Problem(
                "parallel.dp",
                "auto",
                f"tp x pp = {c.tp} x {c.pp} = {per_replica} does not divide the world size {c.world_size} ({c.world_source})",
                "change parallel.tp / parallel.pp, or the cluster, so that tp x pp divides the world size",
            )
    elif c.dp * per_replica != c.world_size:
        yield Problem(
            "parallel.dp x parallel.tp x parallel.pp",
            f"{c.dp} x {c.tp} x {c.pp} = {c.dp * per_replica}",
            f"must equal the world size {c.world_size} ({c.world_source})",
            "set parallel.dp: auto, or change the degrees or the cluster",
        )


def _zero_with_pipeline(c: _Context) -> Iterator[Problem]:
    stage = c.recipe.zero.stage
    if stage >= 2 and c.pp > 1:
        yield Problem(
            "zero.stage",
            stage,
            f"ZeRO-{stage} cannot run with a pipeline (parallel.pp = {c.pp}): every micro-batch would need an "
            "extra reduce-scatter of its gradients before sharding, which the small micro-batches of a pipeline "
            "cannot afford, and the pipeline already divides gradient memory by pp, so sharding saves little "
            "(DeepSpeed only asserts this after all process groups exist)",
            "set zero.stage: 1, or parallel.pp: 1 to use ZeRO-2/3",
        )


def _low_precision_without_zero_under_tp(c: _Context) -> Iterator[Problem]:
    """Without a pipeline and without ZeRO, DeepSpeed's regular engine wraps bf16/fp16 in its unfused fp16
    optimizer, whose gradient norm runs over flattened gradients: the `tensor_model_parallel` marks are gone,
    so TP ranks > 0 count nothing and clipping uses too small a norm (measured at tp 2: 0.86 for 1.24)."""
    dtype = c.recipe.train.dtype
    if c.pp == 1 and c.tp > 1 and dtype in ("bf16", "fp16") and c.recipe.zero.stage == 0:
        yield Problem(
            "zero.stage",
            0,
            f"with parallel.pp = 1, parallel.tp = {c.tp} and train.dtype = {dtype}, DeepSpeed's optimizer without "
            "ZeRO computes the gradient norm over flattened gradients and counts the TP shards of rank 0 only, "
            "so gradient clipping would differ from single-process training",
            "set zero.stage: 1 (or 2, 3), or train.dtype: fp32",
        )


def _tp_inside_node(c: _Context) -> Iterator[Problem]:
    gpn = c.recipe.cluster.gpus_per_node
    if c.tp > gpn or gpn % c.tp:
        yield Problem(
            "parallel.tp",
            c.tp,
            f"a TP group would cross a node boundary (cluster.gpus_per_node = {gpn}); tensor parallelism "
            "all-reduces activations in every layer and needs the fast links inside a node",
            f"choose parallel.tp among the divisors of gpus_per_node: {_divisors(gpn)}",
        )


def _tp_divides_model(c: _Context) -> Iterator[Problem]:
    """Each TP rank owns whole attention heads, whole KV heads and an equal slice of the MLP."""
    dims = {name: c.dim(name) for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    valid = [
        d
        for d in _divisors(c.recipe.cluster.gpus_per_node)
        if all(not v or v % d == 0 for v in dims.values())
    ]
    for name, size in dims.items():
        if size and size % c.tp:
            yield Problem(
                "parallel.tp",
                c.tp,
                f"the model's {name} = {size} is not divisible by tp, so the TP ranks cannot split it evenly",
                f"choose parallel.tp among {valid}",
            )


def _experts_split(c: _Context) -> Iterator[Problem]:
    """Expert parallelism regroups DP ranks (ep divides dp); the experts of every MoE layer are split over
    tp x ep ranks, E / (tp x ep) each; the all-to-all of an EP group should stay inside a node."""
    from dsx3d.models.moe import experts_per_layer, valid_expert_splits

    ep, gpn = c.recipe.parallel.ep, c.recipe.cluster.gpus_per_node
    if ep > 1 and c.dp and c.dp % ep:
        yield Problem(
            "parallel.ep",
            ep,
            f"expert parallelism splits the experts over ep data-parallel ranks, so ep must divide dp = {c.dp}",
            f"choose parallel.ep among {_divisors(c.dp)}",
        )
    experts = None if c.hf_config is None else experts_per_layer(c.hf_config)
    if experts is None:
        if ep > 1 and c.hf_config is not None:
            yield Problem(
                "parallel.ep",
                ep,
                f"the model ({c.hf_config.model_type}) has no mixture-of-experts layers to split",
                "remove parallel.ep (or set it to 1)",
            )
        return
    if experts % (c.tp * ep):
        valid = valid_expert_splits(experts, _divisors(gpn), _divisors(c.dp) if c.dp else [1])
        yield Problem(
            "parallel.ep" if ep > 1 else "parallel.tp",
            ep if ep > 1 else c.tp,
            f"the model's {experts} experts per MoE layer cannot be split evenly over tp x ep = {c.tp} x {ep} "
            "ranks (each rank holds E / (tp x ep) whole experts)",
            f"choose (parallel.tp, parallel.ep) among {valid}",
        )
    if ep > 1 and c.pp == 1:
        yield Problem(
            "parallel.ep",
            ep,
            "expert parallelism is built into the pipeline engine (its EP groups, expert optimizer groups and "
            "per-EP-index checkpoint files); without a pipeline (parallel.pp = 1) DeepSpeed's regular engine "
            "runs and it has no expert-parallel path in dsx3d",
            "set parallel.pp >= 2 to use parallel.ep, or parallel.ep: 1 (the experts are then split over tp only)",
        )
    if ep > 1 and c.recipe.zero.stage >= 3:
        yield Problem(
            "zero.stage",
            c.recipe.zero.stage,
            "DeepSpeed's ZeRO-3 does not partition expert-parallel parameters (it asserts 'MoE not supported "
            "with Stage 3')",
            "set zero.stage: 1 or 2 with parallel.ep > 1, or parallel.ep: 1",
        )
    if ep > 1 and c.dp and not c.dp % ep and Layout(c.dp, c.tp, c.pp, gpn, ep).ep_crosses_node():
        yield _warning(
            "parallel.ep",
            ep,
            f"an EP group spans a block of tp x ep = {c.tp * ep} consecutive ranks that does not fit in one "
            f"node (cluster.gpus_per_node = {gpn}): the all-to-all of every MoE layer crosses nodes",
            f"keep tp x ep a divisor of gpus_per_node (ep among {[e for e in _divisors(c.dp) if not gpn % (e * c.tp)]}), "
            "or accept inter-node all-to-all",
        )


def _vocab_padding(c: _Context) -> Iterator[Problem]:
    vocab = c.dim("vocab_size")
    if vocab and vocab % c.tp:
        padded = -(-vocab // c.tp) * c.tp
        yield _warning(
            "parallel.tp",
            c.tp,
            f"the model's vocab_size = {vocab} is not divisible by tp; the engine pads the vocabulary to "
            f"{padded} (the next multiple of tp) and masks the padding out of the loss",
            "nothing to do, or pick a tp that divides vocab_size to avoid the padding",
        )


def _layers_vs_stages(c: _Context) -> Iterator[Problem]:
    layers = c.dim("num_hidden_layers")
    if layers is not None and layers < c.pp:
        yield Problem(
            "parallel.pp",
            c.pp,
            f"the model has {layers} decoder layer(s), fewer than its {c.pp} pipeline stages",
            f"set parallel.pp to at most {layers}",
        )


def _stage_layers(c: _Context) -> Iterator[Problem]:
    split = c.recipe.parallel.stage_layers
    if split is None:
        return
    key = "parallel.stage_layers"
    if len(split) != c.pp:
        yield Problem(
            key, split, f"has {len(split)} entries but parallel.pp = {c.pp}", "give one count per stage"
        )
    if any(n < 1 for n in split):
        yield Problem(key, split, "every stage needs at least one decoder layer", "make every entry >= 1")
    layers = c.dim("num_hidden_layers")
    if layers is not None and sum(split) != layers:
        yield Problem(
            key,
            split,
            f"sums to {sum(split)} but the model has {layers} decoder layers",
            f"make the entries sum to {layers}, or remove the key for a cost-balanced split",
        )


def _micro_batches_vs_stages(c: _Context) -> Iterator[Problem]:
    m = c.recipe.train.gradient_accumulation_steps
    if c.pp > 1 and m < c.pp:
        yield _warning(
            "train.gradient_accumulation_steps",
            m,
            f"fewer micro-batches than pipeline stages ({c.pp}): the pipeline idles "
            f"{bubble_fraction(c.pp, m):.0%} of each step, (p-1)/(m+p-1)",
            f"use at least {c.pp} micro-batches, ideally 4 x pp = {4 * c.pp} or more "
            f"(bubble {bubble_fraction(c.pp, 4 * c.pp):.0%})",
        )


def _batch_overrides(c: _Context) -> Iterator[Problem]:
    """accelerate's and transformers' "auto" fill train_batch_size with the world size; with a pipeline
    DeepSpeed divides by dp instead and fails at start-up, so dsx3d owns these three keys."""
    train = c.recipe.train
    m, g = train.micro_batch_size, train.gradient_accumulation_steps
    owners = {
        "train_micro_batch_size_per_gpu": ("train.micro_batch_size", m),
        "gradient_accumulation_steps": ("train.gradient_accumulation_steps", g),
        "train_batch_size": ("train.micro_batch_size x train.gradient_accumulation_steps x dp", m * g * c.dp),
    }
    for key, (source, want) in owners.items():
        if key not in c.overrides or c.overrides[key] in (want, AUTO) or (key == "train_batch_size" and not c.dp):
            continue
        yield Problem(
            f"deepspeed.{key}",
            c.overrides[key],
            f"disagrees with {source} = {want} (train_batch_size must be {m} x {g} x {c.dp}: DeepSpeed's "
            f"world for batch arithmetic is the data-parallel size dp = {c.dp}, not the world size {c.world_size})",
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


def _fp16(c: _Context) -> Iterator[Problem]:
    if c.recipe.train.dtype == "fp16":
        yield _warning(
            "train.dtype",
            "fp16",
            "DeepSpeed refuses fp16 on CPU ('Type fp16 is not supported on your device'); fp16 also needs loss scaling",
            "use bf16 (or fp32 on CPU); keep fp16 only for GPUs without bf16",
        )


def _auto_left(c: _Context) -> Iterator[Problem]:
    """"auto" (the form of HF's example DeepSpeed JSONs) is resolved from the recipe where dsx3d derives the
    value; anywhere else DeepSpeed would compare a string with numbers minutes after launch."""
    if not auto_paths(c.overrides) or not c.dp or c.world_size % (c.tp * c.pp):
        return
    config = build_ds_config(c.recipe, c.world_size, hidden_size=c.dim("hidden_size"))
    for path in auto_paths(config):
        yield Problem(
            f"deepspeed.{path}",
            AUTO,
            "dsx3d resolves \"auto\" only where it derives the value from the recipe (batch sizes, precision, "
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


# DeepSpeed's monitor sections -> the package each needs.
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _monitor_packages(c: _Context) -> Iterator[Problem]:
    for section, package in MONITOR_PACKAGES.items():
        conf = c.overrides.get(section)
        if isinstance(conf, dict) and conf.get("enabled") and importlib.util.find_spec(package) is None:
            yield Problem(
                f"deepspeed.{section}.enabled",
                conf["enabled"],
                f"this monitor needs the {package} package, which is not installed",
                f"pip install {package}, or disable the section",
            )


def _data_source(c: _Context) -> Iterator[Problem]:
    """A missing file, a missing field, an empty file, a chat format without a template or too little data
    for one global batch fails only after every rank has started: say it now (dsx3d.data.inspect)."""
    from dsx3d.data.inspect import data_problems

    yield from data_problems(c.recipe, c.dp)


def _evaluation_without_data(c: _Context) -> Iterator[Problem]:
    """train.eval_interval / eval_batches with no held-out data would silently evaluate nothing."""
    train = c.recipe.train
    if not c.recipe.data.has_eval and (train.eval_interval or train.eval_batches):
        key = "train.eval_interval" if train.eval_interval else "train.eval_batches"
        yield _warning(
            key, getattr(train, key.split(".")[1]), "there is no held-out data, so nothing is evaluated",
            "set data.eval_fraction (for example 0.05) or data.eval_source",
        )


def _vocab_holds_the_tokenizer(c: _Context) -> Iterator[Problem]:
    """Token ids past the model's vocabulary fail only once every rank has trained its tokenizer."""
    from dsx3d.data.tokenizer import trained_tokenizer_bound

    bound, vocab = trained_tokenizer_bound(c.recipe), c.dim("vocab_size")
    if bound is not None and vocab is not None and vocab < bound:
        yield Problem(
            "model.config.vocab_size" if c.recipe.model.config is not None else "data.tokenizer_vocab_size",
            vocab if c.recipe.model.config is not None else c.recipe.data.tokenizer_vocab_size,
            f"the byte-level BPE dsx3d trains on the corpus can have up to {bound} tokens (256 bytes, "
            f"<|endoftext|> and merges up to data.tokenizer_vocab_size), more than the model's vocab_size {vocab}",
            f"set model.config.vocab_size to at least {bound}, or data.tokenizer_vocab_size to at most {vocab} "
            "(and vocab_size to at least 257), or give data.tokenizer",
        )


def _model_builds(c: _Context) -> Iterator[Problem]:
    """transformers accepts configs it cannot build (a pad_token_id outside the vocabulary, ...): build the
    model on the meta device (no memory) and name the key when it fails."""
    if c.hf_config is None:
        return
    key = c.hf_config.to_json_string(use_diff=False)
    if key not in _BUILD_PROBLEMS:
        from dsx3d.models.shape import build_meta_model

        try:
            build_meta_model(c.hf_config)
            _BUILD_PROBLEMS[key] = ()
        except UserError as err:
            _BUILD_PROBLEMS[key] = tuple(err.problems)
    yield from _BUILD_PROBLEMS[key]


_BUILD_PROBLEMS: dict[str, tuple[Problem, ...]] = {}
"""What building each config (by its JSON) on the meta device reported: the planner checks hundreds of
candidate layouts of one model, and a large model's meta build takes seconds."""


def _family_supported(c: _Context) -> Iterator[Problem]:
    """Families without plans, or refused after the parity sweep (dsx3d.models.families.REFUSED), stop here,
    before any process starts, instead of failing inside the engine."""
    if c.hf_config is None:
        return
    from dsx3d.models.families import refusal

    reason = refusal(c.hf_config.model_type, c.tp)
    if reason is not None:
        yield Problem(
            "model.config.model_type",
            c.hf_config.model_type,
            f"dsx3d does not support this family ({reason})",
            "pick a supported family (README: supported families)"
            + (" or parallel.tp: 1" if c.tp > 1 else ""),
        )
        return
    try:
        resolve_family(c.hf_config)
    except UserError as err:
        yield from err.problems


def _sequence_parallel(c: _Context) -> Iterator[Problem]:
    """With sequence parallelism each TP rank holds seq_len / tp positions of every activation outside the TP
    regions: seq_len % tp != 0 would fail in the first reduce-scatter. A family whose decoder layers have
    parameters outside the TP regions (MoE routers and experts, unsharded attention) runs without it."""
    if not c.recipe.parallel.sequence_parallel or c.tp == 1:
        return
    reason = _sequence_parallel_blocker(c.hf_config)
    if reason is not None:
        yield _warning(
            "parallel.sequence_parallel",
            True,
            f"this model cannot run sequence parallelism ({reason}); the engine runs plain tensor parallelism "
            "(activations outside the TP regions replicated on every TP rank)",
            "nothing to do, or set parallel.sequence_parallel: false to silence this",
        )
        return
    seq = c.recipe.train.seq_len
    if seq % c.tp:
        fits = [n for n in (seq - seq % c.tp, seq + c.tp - seq % c.tp) if n >= 2]
        yield Problem(
            "train.seq_len",
            seq,
            f"sequence parallelism splits every sequence over the tp = {c.tp} ranks, so it must be a multiple of tp",
            f"set train.seq_len to {' or '.join(map(str, fits))}, or parallel.sequence_parallel: false",
        )


def _sequence_parallel_blocker(hf_config: Any) -> str | None:
    if hf_config is None:
        return None
    from dsx3d.models.shape import sequence_parallel_blocker

    try:
        return sequence_parallel_blocker(hf_config)
    except Exception:  # a family the engine cannot resolve is reported by _family_supported
        return None


def _model_dimensions(c: _Context) -> Iterator[Problem]:
    """Sizes are positive integers below bounds that keep every command's work bounded (the stage split is
    cubic in the layer count); a negative or absurd size would otherwise reach training."""
    if c.hf_config is not None:
        key = "model.config" if c.recipe.model.config is not None else "model.name_or_path (config.json)"
        yield from dimension_problems(c.hf_config, key)


def _seq_len_vs_positions(c: _Context) -> Iterator[Problem]:
    limit = c.dim("max_position_embeddings")
    seq_len = c.recipe.train.seq_len
    if limit is not None and limit > 0 and seq_len > limit:
        yield Problem(
            "train.seq_len",
            seq_len,
            f"longer than the model's max_position_embeddings = {limit}: positions past it are outside what the "
            "model encodes (learned position tables have no row for them)",
            f"set train.seq_len to at most {limit}, or raise the model's max_position_embeddings",
        )


def _output_dir(c: _Context) -> Iterator[Problem]:
    from dsx3d.run.outputs import output_dir_problem

    problem = output_dir_problem(c.recipe.output_dir)
    if problem:
        yield Problem(
            "output_dir", c.recipe.output_dir, problem, "set output_dir to a directory of its own, such as runs/NAME"
        )


def _data_dirs(c: _Context) -> Iterator[Problem]:
    """A local tokenizer directory and the cache directory are checked before any process starts (the data
    source by _data_source)."""
    data = c.recipe.data
    tokenizer = data.tokenizer
    if tokenizer is not None and tokenizer.startswith(("/", "./", "../", "~")) and not Path(tokenizer).expanduser().is_dir():
        yield Problem("data.tokenizer", tokenizer, "not a directory", "point it at a directory of tokenizer files")
    cache = data.cache_dir
    if cache is not None and Path(cache).expanduser().exists() and not Path(cache).expanduser().is_dir():
        yield Problem("data.cache_dir", cache, "exists and is not a directory", "name a directory")


# Where each generated DeepSpeed value comes from, for reporting an override that replaces it. Longest
# matching prefix wins; keys with their own rule above (batch sizes, ZeRO stage, precision) are not repeated.
_OVERRIDE_SOURCES = {
    "gradient_clipping": "train.grad_clip",
    "optimizer.params.lr": "train.lr",
    "optimizer.params.betas": "train.betas",
    "optimizer.params.eps": "train.eps",
    "optimizer.params.weight_decay": "train.weight_decay",
    "optimizer": "dsx3d's AdamW settings from train",
    "scheduler": "train.lr_schedule, train.warmup_steps, train.steps and train.min_lr",
    "pipeline.activation_checkpoint_interval": "train.activation_checkpointing",
    "pipeline": "dsx3d's pipeline settings",
    "dsx3d": "the layout dsx3d records (parallel, cluster, train)",
    "steps_per_print": "dsx3d's own logging",
    "data_types.grad_accum_dtype": "train.dtype (fp32 accumulation for bf16)",
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


def _shadowed(base: dict[str, Any], overrides: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
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
    base = build_ds_config(c.recipe.model_copy(update={"deepspeed": {}}), c.world_size, hidden_size=c.dim("hidden_size"))
    for path, value, generated in _shadowed(base, c.overrides):
        if path in _OWN_RULES:
            continue
        source = next(
            (s for prefix, s in sorted(_OVERRIDE_SOURCES.items(), key=lambda kv: -len(kv[0])) if path == prefix or path.startswith(prefix + ".")),
            "a value dsx3d generates",
        )
        yield _warning(
            f"deepspeed.{path}",
            value,
            f"replaces {generated!r}, which dsx3d derives from {source}; DeepSpeed will use the override",
            f"remove deepspeed.{path} and set {source} instead, if that is what you meant",
        )


def _tracking_packages(c: _Context) -> Iterator[Problem]:
    """train.report_to backends drive the same DeepSpeed monitors (dsx3d.run.tracking); csv needs no package."""
    for backend in c.recipe.train.report_to:
        package = MONITOR_PACKAGES.get(backend)
        if package is not None and importlib.util.find_spec(package) is None:
            yield Problem(
                "train.report_to",
                backend,
                f"the {backend} backend needs the {package!r} package, which is not installed",
                f"pip install {package} (or `pip install dsx3d[tracking]`), or remove {backend!r} from train.report_to",
            )


def _lora(c: _Context) -> Iterator[Problem]:
    """model.lora: targets that exist and are decoder-layer linears, a peft config dsx3d can train
    (`dsx3d.lora_rules`), checked before any process starts."""
    from dsx3d.lora_rules import lora_problems

    yield from lora_problems(c.recipe, c.hf_config)


def _schedule(c: _Context) -> Iterator[Problem]:
    """parallel.schedule: what zero bubble needs (`dsx3d.schedule_rules`)."""
    from dsx3d.schedule_rules import schedule_problems

    yield from schedule_problems(c.recipe, c.hf_config)


RULES: list[Rule] = [
    _model_dimensions,
    _seq_len_vs_positions,
    _output_dir,
    _data_dirs,
    _shadowing_overrides,
    _world_size_matches,
    _zero_with_pipeline,
    _low_precision_without_zero_under_tp,
    _tp_inside_node,
    _tp_divides_model,
    _experts_split,
    _vocab_padding,
    _layers_vs_stages,
    _stage_layers,
    _micro_batches_vs_stages,
    _batch_overrides,
    _grad_accum_dtype,
    _contradicting_overrides,
    _fp16,
    _auto_left,
    _deepspeed_timers,
    _monitor_packages,
    _family_supported,
    _sequence_parallel,
    _model_builds,
    _tracking_packages,
    _lora,
    _schedule,
]

# Rules about the recipe's own data pipeline (`dsx3d train`); the engine alone (the Trainer, verify) reads none.
DATA_RULES: list[Rule] = [
    _data_source,
    _evaluation_without_data,
    _vocab_holds_the_tokenizer,
]


def check_recipe(
    recipe: Recipe, world_size: int | None = None, hf_config: Any = None, *, data: bool = True
) -> list[Problem]:
    """Every problem of `recipe` on `world_size` ranks (default: the cluster's), errors and warnings;
    with `data`, also of the data pipeline `dsx3d train` runs (`DATA_RULES`).

    Without `hf_config` the model's config is read from the recipe; if that fails, the failure is one of
    the problems and the rules that need the model are skipped.
    """
    problems: list[Problem] = []
    if hf_config is None:
        try:
            hf_config = load_hf_config(recipe.model)
        except UserError as err:
            problems.extend(err.problems)
    if world_size is not None:
        source = f"--world-size {world_size}"
    else:
        world_size = recipe.cluster_world_size
        source = (
            f"cluster.nodes {recipe.cluster.nodes} x cluster.gpus_per_node {recipe.cluster.gpus_per_node}"
        )
    ctx = _Context(recipe, world_size, source, recipe.resolved_dp(world_size), hf_config)
    for rule in RULES + (DATA_RULES if data else []):
        problems.extend(rule(ctx))
    return problems


def raise_for_errors(problems: list[Problem]) -> None:
    """Log the warnings; raise a `UserError` carrying every error, if there is any."""
    for p in problems:
        if p.severity != "error":
            log.warning("%s", p)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise UserError(errors)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
