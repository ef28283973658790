"""Checks of context parallelism (parallel.cp > 1): what a Ulysses split of every sequence needs from the
sequence length, the heads and the family, and which combinations with other features are refused and why.

Ulysses exchanges each layer's q, k and v from sequence slices to head groups: the heads a TP rank holds must
split evenly over cp (kv heads may instead be fewer, with cp a multiple of them: each is then repeated, which
is exact). The rest of a decoder layer is token-wise, so any family whose attention is one HF attention call
over (b, heads, s, head_dim) tensors with the whole sequence's mask splits exactly; what does not fit that
shape is refused by name (`CP_REFUSED`), and so is what is not shown equal to single-process HF yet.
"""

from __future__ import annotations

from collections.abc import Iterator

from dsx3d.checks.context import _Context
from dsx3d.errors import Problem

CP_REFUSED: dict[str, str] = {}
"""model_type -> why its attention does not split by heads over CP ranks (filled from measured parity runs:
tests/distributed/test_context_parallel.py)."""


def _cp(c: _Context) -> int:
    return c.recipe.parallel.cp


def _seq_len(c: _Context) -> Iterator[Problem]:
    """Every CP rank holds seq_len / cp positions; with sequence parallelism each TP rank a further 1/tp."""
    cp, seq = _cp(c), c.recipe.train.seq_len
    if cp == 1:
        return
    parts = cp * c.tp if c.recipe.parallel.sequence_parallel and c.tp > 1 else cp
    if seq % parts:
        fits = [n for n in (seq - seq % parts, seq + parts - seq % parts) if n >= parts]
        what = f"cp x tp = {cp} x {c.tp}" if parts != cp else f"cp = {cp}"
        yield Problem(
            "train.seq_len",
            seq,
            f"context parallelism splits every sequence over {what} = {parts} slices, so it must be a multiple of {parts}",
            f"set train.seq_len to {' or '.join(map(str, fits))}, or change parallel.cp",
        )


def _heads(c: _Context) -> Iterator[Problem]:
    """Heads per TP rank divisible by cp; kv heads per TP rank divisible by cp, or cp a multiple of them."""
    cp = _cp(c)
    heads, kv = c.dim("num_attention_heads"), c.dim("num_key_value_heads")
    if cp == 1 or heads is None:
        return
    tp = c.tp if _heads_split(c) else 1  # a plan that keeps attention whole: every TP rank has all heads
    if heads % tp:
        return  # the TP rules report heads that tp does not divide
    local = heads // tp
    if local % cp:
        fits = [d for d in range(1, local + 1) if local % d == 0]
        yield Problem(
            "parallel.cp",
            cp,
            f"Ulysses attention gives each CP rank heads / (tp x cp) query heads, and the {local} heads per TP "
            f"rank (num_attention_heads {heads} / tp {tp}) do not split into {cp}",
            f"set parallel.cp to one of {fits}",
        )
        return
    kv = kv or heads
    if kv % tp:
        return
    local_kv = kv // tp
    if local_kv % cp and cp % local_kv:
        yield Problem(
            "parallel.cp",
            cp,
            f"the {local_kv} key/value heads per TP rank (num_key_value_heads {kv} / tp {tp}) neither split "
            f"into cp = {cp} groups nor repeat evenly over them",
            f"set parallel.cp to a divisor or a multiple of {local_kv} that divides {local}",
        )


def _heads_split(c: _Context) -> bool:
    """Whether TP splits the attention heads of this model (`dsx3d.models.meta_build.attention_heads_split`)."""
    if c.tp == 1 or c.hf_config is None:
        return True
    from dsx3d.models.meta_build import attention_heads_split

    try:
        return attention_heads_split(c.hf_config)
    except Exception:  # a config the meta build rejects is reported by the model checks
        return True


def _sinks(config: object) -> bool:
    """Whether the meta model's layers hold per-head attention sinks (a family whose TP plan replicates
    attention does not name them)."""
    from dsx3d.models.meta_build import attention_sinks

    try:
        return attention_sinks(config) is not None  # type: ignore[arg-type]
    except Exception:  # a config the meta build rejects is reported by the model checks
        return False


def _family(c: _Context) -> Iterator[Problem]:
    """Families whose attention does not split by heads."""
    cp, config = _cp(c), c.hf_config
    if cp == 1 or config is None:
        return
    text = config.get_text_config()
    reason = CP_REFUSED.get(text.model_type)
    plan = getattr(text, "base_model_tp_plan", None) or {}
    splits = {"full_attention", "sliding_attention"}
    others = sorted(set(getattr(text, "layer_types", None) or []) - splits)
    if reason is None and others:
        reason = (
            f"layers of type {', '.join(others)} carry a state along the sequence (a recurrent scan), which "
            "cannot run on a slice and has no attention heads to exchange; only full and sliding-window "
            "attention layers split over CP ranks"
        )
    if reason is None and (any(k.endswith((".sinks", ".s_aux")) for k in plan) or _sinks(config)):
        reason = (
            "its attention has learned per-head sinks, a parameter the attention function itself reads for the "
            "heads this TP rank holds; after the Ulysses exchange a CP rank holds a different subset of heads"
        )
    if reason is not None:
        yield Problem(
            "parallel.cp", cp, f"{text.model_type}: {reason}", "set parallel.cp: 1 (use parallel.tp to split this model)"
        )
        return


def _combinations(c: _Context) -> Iterator[Problem]:
    """Features not shown equal to single-process HF with cp > 1."""
    cp = _cp(c)
    if cp == 1:
        return
    parallel = c.recipe.parallel
    if parallel.ep > 1:
        yield Problem(
            "parallel.cp",
            cp,
            f"expert parallelism (parallel.ep = {parallel.ep}) regroups the data-parallel ranks that context "
            "parallelism also splits",
            "set parallel.cp: 1, or parallel.ep: 1",
        )


def context_parallel_problems(c: _Context) -> Iterator[Problem]:
    for rule in (_seq_len, _heads, _family, _combinations):
        yield from rule(c)
