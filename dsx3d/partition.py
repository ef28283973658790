"""Splitting the pipeline's layers into stages by cost (pure).

Uniform-by-count splits ignore that the vocab-sized head (and the embedding's memory) sit on the end stages;
on a tiny Llama DeepSpeed's default put 1.6-1.9x the work on the last stage. We weight every pipeline layer
by its forward FLOPs per token and pick contiguous stages that minimise the most loaded one.
"""

from __future__ import annotations

from typing import Any


def layer_costs(config: Any, seq_len: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of (embedding, one decoder layer, LM head) for an HF text config.

    Decoder layer: 2 x its matmul parameters (q, k, v, o and a gated or plain MLP) plus attention scores and
    values, 4 x seq_len x num_heads x head_dim. Head: 2 x hidden x vocab. The embedding is a lookup, ~0.
    """
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        return _layer_costs(c, seq_len)
    except Exception:  # heterogeneous configs (per-layer head_dim...): fall back to parameter-free weights
        return 0.0, 1.0, 1.0


def _layer_costs(c: Any, seq_len: int) -> tuple[float, float, float]:
    h = c.hidden_size
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    inter = getattr(c, "intermediate_size", None) or 4 * h
    gated = getattr(c, "hidden_act", "gelu") in ("silu", "swiglu") or hasattr(c, "mlp_bias")
    attn_params = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp_params = h * inter * (3 if gated else 2)
    layer = 2.0 * (attn_params + mlp_params) + 4.0 * seq_len * heads * head_dim
    head = 2.0 * h * c.vocab_size
    return 0.0, layer, head


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
