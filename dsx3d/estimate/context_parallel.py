"""What context parallelism (cp) and the tiled loss change in an estimate.

Ulysses-style context parallelism splits every sequence of s tokens over the cp ranks of a CP group. Outside
attention a rank holds s/cp tokens: norms, projections, the MLP, the pipeline messages and the TP collectives
all see s/cp tokens, so their activations, FLOPs and traffic are divided by cp. Around attention an all-to-all
turns the sequence shard of q, k and v into a head shard (a/(t*cp) query heads of the whole sequence), and a
second one turns the attention output back. Per rank that is the same number of values as before the
exchange, so the saved q, k, v and output keep their per-token size at s/cp tokens; the s x s score matrix of
an unfused attention shrinks with the heads: (a/(t*cp)) * s^2 values, i.e. a*s/t per local token. KV heads are
replicated when there are fewer of them per TP rank than cp (kv/t < cp): each rank then holds one whole KV
head, as if there were t*cp of them.

All-to-all traffic per decoder layer and micro-batch: q, k, v and the attention output each cross the CP
group once forward and once backward (again forward with activation checkpointing, the recomputation); a
rank keeps 1/cp of each tensor and sends (cp-1)/cp of it. The tensors of one rank are b * s/cp tokens of
a*d/t (q, output) and kv'*d/t (k, v) values.

ZeRO states and the gradient exchange run over DeepSpeed's data axis, dp x cp ranks (the CP ranks hold the
same weights), so states are partitioned cp times finer and the DP traffic factor is that of dp x cp ranks.

The last stage's logits: whole, b * s/cp tokens of V/t logits in the model dtype, kept for the backward, and
the vocab-parallel cross-entropy's fp32 softmax (saved) and transients (8 bytes, plus 4 for the fp32 copy of
16-bit logits): (w + 12 [+ 4]) * V/t per token. Tiled (`train.loss_tile_tokens` N > 0): nothing of the
logits is kept between forward and backward; the forward and the backward's recomputation hold one tile at a
time, min(N, b * s/cp) tokens of the same per-token buffers (in the backward the logits' gradient takes the
place of the shifted logits).
"""

from __future__ import annotations


def kv_heads_held(num_kv_heads: int, tp: int, cp: int) -> int:
    """KV heads as if un-replicated: kv, or t*cp when a TP rank holds fewer than cp of them (each CP rank then
    keeps one whole head)."""
    if cp == 1 or num_kv_heads == 0:
        return num_kv_heads
    return max(num_kv_heads, tp * cp)


def alltoall_bytes_per_micro_batch(
    *,
    layers: int,
    cp: int,
    tp: int,
    seq_len: int,
    micro_batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    width: int,
    checkpointing: bool,
) -> float:
    """Bytes one rank sends over its CP group for `layers` decoder layers and one micro-batch (module
    docstring): (cp-1)/cp of q, k, v and the output, each once forward, once backward, once more when
    recomputed."""
    if cp == 1 or layers == 0:
        return 0.0
    kv = kv_heads_held(num_kv_heads, tp, cp)
    tokens = seq_len * micro_batch / cp
    tensors = tokens * (2 * num_heads + 2 * kv) * head_dim / tp * width
    passes = 3 if checkpointing else 2
    return layers * passes * (cp - 1) / cp * tensors


def logits_bytes(*, tokens: float, vocab_per_rank: float, width: int, tile_tokens: int = 0) -> float:
    """The last stage's logits and cross-entropy buffers for `tokens` tokens of one micro-batch on one rank
    (module docstring); `tile_tokens` > 0: one tile of at most that many tokens."""
    held = tokens if tile_tokens <= 0 else min(float(tile_tokens), tokens)
    return held * (width + 12 + (4 if width < 4 else 0)) * vocab_per_rank
