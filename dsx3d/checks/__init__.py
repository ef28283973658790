"""The recipe checker: every rule that would otherwise fail late, deep in DeepSpeed, or silently.

`check_recipe` is a pure function of the recipe, a world size and the model's HF config. It runs every rule
and returns every problem at once, so one `dsx3d check` shows all there is to fix. Each rule is a small
function in `RULES`; each problem names the key path, the value, the reason and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from dsx3d.boundary_types import HFConfig
from dsx3d.checks.context import Rule, _Context, _warning
from dsx3d.checks.context_parallel import context_parallel_problems
from dsx3d.checks.deepspeed import (
    _async_save_writer,
    _auto_left,
    _batch_overrides,
    _contradicting_overrides,
    _deepspeed_schema,
    _deepspeed_timers,
    _fp16,
    _grad_accum_dtype,
    _scheduler_override,
    _shadowing_overrides,
)
from dsx3d.checks.dpo import objective_problems
from dsx3d.checks.environment import _data_dirs, _monitor_packages, _output_dir, _tracking_packages
from dsx3d.checks.lora import _lora
from dsx3d.checks.model import (
    _family_supported,
    _model_builds,
    _model_dimensions,
    _seq_len_vs_positions,
)
from dsx3d.checks.parallel import (
    _experts_split,
    _layers_vs_stages,
    _low_precision_without_zero_under_tp,
    _micro_batches_vs_stages,
    _sequence_parallel,
    _stage_layers,
    _tp_divides_model,
    _tp_inside_node,
    _vocab_padding,
    _world_size_matches,
    _zero_with_pipeline,
)
from dsx3d.checks.tiled_loss import _loss_tiles
from dsx3d.errors import Problem, UserError
from dsx3d.recipe.hf_config import load_hf_config
from dsx3d.recipe.schema import Recipe

log = logging.getLogger("dsx3d")




def _data_source(c: _Context) -> Iterator[Problem]:
    """A missing file, a missing field, an empty file, a chat format without a template or too little data
    for one global batch fails only after every rank has started: say it now (dsx3d.checks.data)."""
    from dsx3d.checks.data import data_problems

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


def _schedule(c: _Context) -> Iterator[Problem]:
    """parallel.schedule: what zero bubble needs (`dsx3d.checks.schedule`)."""
    from dsx3d.checks.schedule import schedule_problems

    yield from schedule_problems(c.recipe, c.hf_config)


RULES: list[Rule] = [
    _model_dimensions,
    _seq_len_vs_positions,
    _output_dir,
    _data_dirs,
    _shadowing_overrides,
    _scheduler_override,
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
    _async_save_writer,
    _fp16,
    _auto_left,
    _deepspeed_schema,
    _deepspeed_timers,
    _monitor_packages,
    _family_supported,
    _sequence_parallel,
    context_parallel_problems,
    _model_builds,
    _tracking_packages,
    _lora,
    _schedule,
    _loss_tiles,
    objective_problems,
]

# Rules about the recipe's own data pipeline (`dsx3d train`); the engine alone (the Trainer, verify) reads none.
DATA_RULES: list[Rule] = [
    _data_source,
    _evaluation_without_data,
    _vocab_holds_the_tokenizer,
]


def check_recipe(
    recipe: Recipe, world_size: int | None = None, hf_config: HFConfig | None = None, *, data: bool = True
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


