"""Splitting the pipeline's layers into stages by cost (pure).

Uniform-by-count splits ignore that the vocab-sized head (and the embedding's memory) sit on the end stages;
on a tiny Llama DeepSpeed's default put 1.6-1.9x the work on the last stage. We weight every pipeline layer
by its forward FLOPs per token (from `dsx3d.models.shape`, the one reader of model dimensions) and pick
contiguous stages that minimise the most loaded one. The engine (`dsx3d.pipeline.module.stage_bounds`) and
the estimator both call `decoder_split`.
"""

from __future__ import annotations

from functools import lru_cache

from dsx3d.boundary_types import HFConfig
from dsx3d.errors import UserError
from dsx3d.models.shape import ModelShape, ParamCount, shape_from_hf_config, text_config


def pipeline_costs(shape: ModelShape, seq_len: int) -> list[float]:
    """Forward FLOPs per token of the pipeline items [embedding, L decoder layers, final norm, head].

    Decoder layer: 2 x the parameters a token multiplies through (q, k, v, o and a gated or plain MLP; the
    router, shared experts and top-k experts of an MoE layer) plus attention scores and values,
    4 x seq_len x num_heads x head_dim. Head: 2 x hidden x vocab. The embedding is a lookup and the norm
    elementwise: ~0.
    """
    attention = 4.0 * seq_len * shape.attention_width
    layers = [2.0 * layer.flop_params + attention for layer in shape.layer_shapes()]
    return [0.0, *layers, 0.0, 2.0 * shape.head]


def decoder_split(shape: ModelShape, pp: int, seq_len: int) -> list[int]:
    """Decoder layers per stage of the cost-balanced split: what the engine builds and the estimator
    estimates. Every stage gets at least one decoder layer, even when the vocab-sized head alone outweighs
    a stage's share: a stage of only the embedding or only the head is a pipeline hop that adds a bubble
    slot without relieving the bottleneck stage (`parallel.stage_layers` may still ask for one)."""
    return list(_decoder_split(shape, pp, seq_len))


@lru_cache(maxsize=512)
def _decoder_split(shape: ModelShape, pp: int, seq_len: int) -> tuple[int, ...]:
    if pp > shape.num_layers:
        raise UserError.single(
            "parallel.pp", pp, f"more stages than the model's {shape.num_layers} layers", f"use pp <= {shape.num_layers}"
        )
    costs = pipeline_costs(shape, seq_len)
    bounds = balanced_bounds(decoder_units(costs), pp)
    return tuple(stop - start for start, stop in zip(bounds[:-1], bounds[1:]))


def decoder_units(costs: list[float]) -> list[float]:
    """The costs of [embedding, L decoder layers, final norm, head] folded into L units, one per decoder
    layer: the embedding goes with the first layer and the norm and head with the last, so that stages cut
    between units each hold at least one decoder layer."""
    units = costs[1:-2]
    units[0] += costs[0]
    units[-1] += costs[-2] + costs[-1]
    return units


def stage_layers_for(config: HFConfig, pp: int, seq_len: int, stage_layers: list[int] | None) -> list[int]:
    """Decoder layers per stage: the recipe's `parallel.stage_layers`, else the cost-balanced split (the
    estimator's too). A config whose dimensions cannot be read as one shape (per-layer head counts) is split
    evenly by layer count."""
    if stage_layers is not None:
        return list(stage_layers)
    try:
        shape = shape_from_hf_config(config)
    except Exception:  # heterogeneous configs (per-layer head_dim...) refuse global access to their dims
        n = text_config(config).num_hidden_layers
        shape = ModelShape(num_layers=n, layer=ParamCount(sharded=1), layer_flop_params=1, head=1)
    return decoder_split(shape, pp, seq_len)


def balanced_bounds(costs: list[float], num_stages: int) -> list[int]:
    """Stage boundaries [0, b1, ..., len(costs)] over contiguous items, every stage non-empty, minimising
    the largest stage cost (exact dynamic programme; ties go to earlier, smaller prefixes)."""
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need at least as many layers, got {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-stage cost of the first i items in k stages; cut[k][i] the last boundary
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def bounds_from_stage_layers(stage_layers: list[int], num_extra_first: int, num_extra_last: int) -> list[int]:
    """Boundaries for an explicit per-stage decoder-layer count; the first stage also holds the
    `num_extra_first` prologue items, the last the `num_extra_last` epilogue/head items."""
    bounds = [0]
    for i, count in enumerate(stage_layers):
        bounds.append(bounds[-1] + count + (num_extra_first if i == 0 else 0))
    bounds[-1] += num_extra_last
    return bounds


_MAX_LAYOUT = 1 << 20


def original_repr(layout: str) -> str:
    return repr(layout if len(layout) <= 80 else layout[:77] + "...")


_LAYOUT_SYMBOLS = {"E": "the embedding", "t": "a decoder layer", "L": "the final norm, head and loss"}


def parse_layout(layout: str) -> list[int]:
    """Decoder layers per stage from a Megatron-style layout string (`--pipeline-model-parallel-layout`):
    stages separated by `|`, `E` the embedding, `t` a decoder layer, `L` the head and loss, `X*N` or `(...)*N`
    repeats; spaces and commas are ignored. dsx3d keeps the embedding on the first stage and the head on the
    last, so `E` may only open the first stage and `L` only close the last (both may be left out).
    "Et*3|t*4|tttL" -> [3, 4, 3]. Raises ValueError saying what is wrong."""
    text = "".join(ch for ch in layout if not ch.isspace() and ch != ",")
    expanded, end = _expand(text, 0, layout)
    if end != len(text):
        raise ValueError(f"unbalanced ')' in {original_repr(layout)}")
    stages = expanded.split("|")
    for i, stage in enumerate(stages):
        bad = sorted(set(stage) - set(_LAYOUT_SYMBOLS))
        if bad:
            raise ValueError(f"unknown symbol(s) {bad}; a layout uses E, t, L, |, ( ) and *N")
        if "E" in stage and (i != 0 or stage.count("E") > 1 or not stage.startswith("E")):
            raise ValueError("E (the embedding) may appear once, at the start of the first stage")
        if "L" in stage and (i != len(stages) - 1 or stage.count("L") > 1 or not stage.endswith("L")):
            raise ValueError("L (the head and loss) may appear once, at the end of the last stage")
    return [stage.count("t") for stage in stages]


def _expand(text: str, pos: int, original: str) -> tuple[str, int]:
    """Expand `X*N` and `(...)*N` from `pos` to the matching `)` or the end; returns (text, end position)."""
    out: list[str] = []
    while pos < len(text):
        ch = text[pos]
        if ch == ")":
            return "".join(out), pos
        if ch == "(":
            inner, end = _expand(text, pos + 1, original)
            if end >= len(text):
                raise ValueError(f"unbalanced '(' in {original_repr(original)}")
            unit, pos = inner, end + 1
        elif ch == "*":
            raise ValueError(f"'*' without a symbol or group before it in {original_repr(original)}")
        else:
            unit, pos = ch, pos + 1
        if pos < len(text) and text[pos] == "*":
            digits = ""
            pos += 1
            while pos < len(text) and text[pos].isdigit():
                digits += text[pos]
                pos += 1
            if not digits or not 1 <= int(digits) <= _MAX_LAYOUT or len(unit) * int(digits) > _MAX_LAYOUT:
                raise ValueError(f"'*' needs a count from 1 up to {_MAX_LAYOUT} symbols in all, in {original_repr(original)}")
            unit *= int(digits)
        out.append(unit)
        if sum(map(len, out)) > _MAX_LAYOUT:
            raise ValueError(f"more than {_MAX_LAYOUT} symbols in {original_repr(original)}")
    return "".join(out), pos


def layout_string(stage_layers: list[int]) -> str:
    """The layout string of a per-stage split ([3, 4, 3] -> "Et*3|t*4|t*3L")."""
    parts = [f"t*{n}" if n else "" for n in stage_layers]
    parts[0] = "E" + parts[0]
    parts[-1] += "L"
    return "|".join(parts)


def with_layout_counts(section: object) -> object:
    """The recipe's `parallel` mapping with `stage_layers` set from its `pipeline_layout` (schema validation)."""
    if not isinstance(section, dict) or section.get("pipeline_layout") is None:
        return section
    layout = section["pipeline_layout"]
    if not isinstance(layout, str):
        return section  # the field's own type check reports it
    if section.get("stage_layers") is not None:
        raise ValueError("give one of parallel.pipeline_layout and parallel.stage_layers, not both")
    try:
        counts = parse_layout(layout)
    except ValueError as e:
        raise ValueError(f"parallel.pipeline_layout {original_repr(layout)}: {e}") from None
    return {**section, "stage_layers": counts}


def stage_of(rank: int, chunk: int, pp: int, shape: str = "looped") -> int:
    """The pipeline stage of chunk `chunk` on rank `rank`: looped, stage chunk x pp + rank; V-shaped (two chunks),
    rank r holds stages r and 2 pp - 1 - r, so the first and the last stage are both on rank 0."""
    if shape == "v":
        if chunk not in (0, 1):
            raise ValueError(f"a V-shaped placement has two chunks per rank, not chunk {chunk}")
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of(stage: int, pp: int, shape: str = "looped") -> int:
    """The rank holding pipeline stage `stage` (the inverse of `stage_of`)."""
    if shape == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def looped_placement(
    bounds: list[int], pp: int, v: int, shape: str = "looped"
) -> tuple[list[int], list[int], list[list[int]]]:
    """Virtual stages placed on ranks (`stage_of`: looped, chunk c of rank r is stage c pp + r of v pp; or
    V-shaped), given `bounds` over the v pp stages: (the items in rank order, so that each rank's chunks are
    contiguous as DeepSpeed's partition wants them; the ranks' bounds over that order; per rank, its chunks'
    bounds within its own items)."""
    if len(bounds) != pp * v + 1:
        raise ValueError(f"{pp} ranks x {v} chunks need {pp * v + 1} bounds, got {len(bounds)}")
    order: list[int] = []
    parts, chunks = [0], []
    for r in range(pp):
        local = [0]
        for c in range(v):
            s = stage_of(r, c, pp, shape)
            order += range(bounds[s], bounds[s + 1])
            local.append(local[-1] + bounds[s + 1] - bounds[s])
        parts.append(parts[-1] + local[-1])
        chunks.append(local)
    return order, parts, chunks
