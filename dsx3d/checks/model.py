"""Checks of the model: that it builds, that its family is supported, its dimensions and its positions against seq_len."""

from __future__ import annotations

from collections.abc import Iterator

from dsx3d.checks.context import _Context
from dsx3d.errors import Problem, UserError
from dsx3d.models.family_spec import resolve_family
from dsx3d.recipe.hf_config import dimension_problems


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
    """Families without plans, or refused after the parity sweep (dsx3d.models.known_families.REFUSED), stop here,
    before any process starts, instead of failing inside the engine."""
    if c.hf_config is None:
        return
    from dsx3d.models.known_families import refusal

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
