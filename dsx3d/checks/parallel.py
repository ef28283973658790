"""Checks of the layout: world size, dp x tp x pp against the model (heads, experts, vocabulary, layers), stages and micro-batches, sequence parallelism."""

from __future__ import annotations

from collections.abc import Iterator

from dsx3d.boundary_types import HFConfig
from dsx3d.checks.context import _Context, _divisors, _warning
from dsx3d.errors import Problem
from dsx3d.plan.layout import Layout, bubble_fraction


def _world_size_matches(c: _Context) -> Iterator[Problem]:
    cp = c.recipe.parallel.cp
    per_replica = c.tp * c.pp * cp
    degrees, names = (f"{c.tp} x {c.pp}", "tp x pp") if cp == 1 else (f"{cp} x {c.tp} x {c.pp}", "cp x tp x pp")
    if c.recipe.parallel.dp == "auto":
        if c.world_size % per_replica:
            yield Problem(
                "parallel.dp",
                "auto",
                f"{names} = {degrees} = {per_replica} does not divide the world size {c.world_size} ({c.world_source})",
                f"change parallel.{names.replace(' x ', ' / parallel.')}, or the cluster, so that {names} divides the world size",
            )
    elif c.dp * per_replica != c.world_size:
        key = "parallel.dp x parallel.tp x parallel.pp" if cp == 1 else "parallel.dp x parallel.cp x parallel.tp x parallel.pp"
        yield Problem(
            key,
            f"{c.dp} x {degrees} = {c.dp * per_replica}",
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
    so TP ranks > 0 count nothing and clipping uses too small a norm."""
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
    key, value = "parallel.stage_layers", split
    layout = c.recipe.parallel.pipeline_layout
    if layout is not None:  # the counts came from the layout string: name what the user wrote
        key, value = "parallel.pipeline_layout", f"{layout} (decoder layers per stage {split})"  # type: ignore[assignment]
    if len(split) != c.pp:
        yield Problem(key, value, f"has {len(split)} {'stages' if layout else 'entries'} but parallel.pp = {c.pp}", "give one entry per stage")
    if any(n < 0 for n in split):
        yield Problem(key, value, "has a negative count", "make every entry >= 0")
    middle = [i for i, n in enumerate(split) if n == 0 and 0 < i < len(split) - 1]
    if middle:
        # the first stage keeps the embedding and the last the head; a middle stage would hold nothing
        yield Problem(
            key,
            value,
            f"stage(s) {middle} would hold no layer and no parameter (DeepSpeed cannot build an optimizer "
            "over none); only the first and the last stage may have 0 decoder layers",
            "give every middle stage at least one decoder layer, or remove the key for a cost-balanced split",
        )
    layers = c.dim("num_hidden_layers")
    if layers is not None and sum(split) != layers:
        yield Problem(
            key,
            value,
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


_BLOCKERS: dict[str, str | None] = {}
"""Blockers by config (a meta model per call is costly; the planner checks many layouts of one model)."""


def _sequence_parallel_blocker(hf_config: HFConfig | None) -> str | None:
    if hf_config is None:
        return None
    from dsx3d.models.shape import sequence_parallel_blocker

    key = hf_config.to_json_string(use_diff=False)
    if key not in _BLOCKERS:
        try:
            _BLOCKERS[key] = sequence_parallel_blocker(hf_config)
        except Exception:  # a family the engine cannot resolve is reported by _family_supported
            _BLOCKERS[key] = None
    return _BLOCKERS[key]
