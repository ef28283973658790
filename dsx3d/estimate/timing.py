"""Step time: FLOPs over achieved throughput, the pipeline bubble, and TP / PP / DP traffic over links.

FLOPs per token (Kaplan et al. 2020; Narayanan et al. 2021, Sec. 5.1): 6*N for the matmuls (forward 2N,
backward 4N; N = decoder parameters a token passes through plus the head) and 12*L*h*s for attention
(QK^T and AV: 4*s*h per token and layer forward, times 3). Full activation checkpointing recomputes the
forward of the decoder layers: 8*N and 16*L*h*s there. A stage's time per micro-batch is its FLOPs over
tp * peak * efficiency plus its TP and p2p traffic; a synchronous 1F1B step takes (m + p - 1) of the
slowest stage's micro-batch times, i.e. T_ideal / (1 - bubble) with bubble = (p - 1) / (m + p - 1) when
stages are balanced.

Traffic (bytes one rank sends, ring collectives: an all-reduce over g ranks moves 2*(g-1)/g of the
buffer, an all-gather or reduce-scatter (g-1)/g):
  TP (Megatron-style, Shoeybi et al. 2019): collectives of b*s*h per layer and micro-batch. Without
     sequence parallelism: one all-reduce forward per row-parallel linear (a region's exit) and one backward
     per region entry (the column-parallel linears of one module read one input and share it: q/k/v, gate/up:
     2 + 2 for a Llama layer, Megatron's minimum), the forward ones again with checkpointing (the
     recomputation); counted from the family's TP plan (`ModelShape.tp_*`, measured by
     scripts/bench/comm.py). With sequence parallelism (Korthikanti et al. 2022) every entry all-gathers
     forward and reduce-scatters backward, every exit the reverse: (g-1)/g of the buffer each, the same
     bytes as the all-reduces when entries equal exits, and recomputation repeats both forward halves.
     `colwise_gather_output` and `rowwise_split_input` styles add an all-gather of their sharded side
     forward / backward. Plus, per micro-batch: the vocab-parallel embedding's forward all-reduce of b*s*h
     (first stage; with sequence parallelism a reduce-scatter forward, an all-gather backward); the head's
     input-gradient all-reduce of b*s*h (with sequence parallelism an all-gather forward and a reduce-scatter
     backward) and the vocab-parallel cross-entropy's three fp32 all-reduces of b*s (last stage); gradients
     of parameters kept whole on every TP rank (q/k norms, and with sequence parallelism the norms and
     post-reduce biases that see sequence shards). An MoE experts region (never under sequence parallelism)
     all-reduces its output forward and its input's gradient backward (b*s*h), and its routing weights'
     gradient (b*s*k, fp32). Intra-node link.
  EP (MoE, ep > 1): per MoE layer and micro-batch, each rank sends its TP slot's routes (b*s*k/t rows of h)
     to the EP ranks holding their experts and gets the results back, all-to-all twice forward, twice
     backward, twice more with checkpointing; with routes spread evenly, (ep-1)/ep of the rows leave the
     rank.
  PP: per micro-batch and stage boundary, the activations forward (b*s*h, plus the b*s int64 token ids that
     travel with them so every stage rebuilds masks and rotary tables) and their gradient backward (b*s*h);
     with sequence parallelism each TP rank sends only its shard, b*s*h/t.
  DP, of the stage's per-device parameters P, with s' = (d-1)/d (for experts d = dp / ep, their
     expert-data-parallel group): ZeRO-0 all-reduces the gradients once per
     step, 2s'*P; ZeRO-1 3s'*P (DeepSpeed all-reduces the whole gradient at the accumulation boundary, then
     all-gathers the updated partition: 1.5x DDP's traffic); ZeRO-2 reduce-scatters in every micro-batch's
     backward (its gradients are partitioned, DeepSpeed's stage_1_and_2.py) and all-gathers the updated
     weights once, (m+1)s'*P; ZeRO-3 gathers the weights for every forward and backward and
     reduce-scatters every micro-batch, 3m*s'*P. For m = 1 these are the ZeRO paper's 2x, 2x and 3x
     (Sec. 7). Counted as not overlapped with compute (a pessimistic bound).
  Tied embedding/head (pp > 1): an all-reduce of V*h/t over the first and last stage.
  CP (context parallelism): the all-to-alls around attention (`dsx3d.estimate.context_parallel`); every other term
     above counts the s/cp tokens a rank holds, and the DP exchange runs over dp x cp ranks.
A group uses the inter-node bandwidth when its ranks span nodes (rank order pipe, data, model as in
`dsx3d.plan.layout.Layout`), else the intra-node one. The bubble is `dsx3d.plan.layout.bubble_fraction`.
"""

from __future__ import annotations

from dsx3d.models.shape import ModelShape


def ring_allreduce_factor(group: int) -> float:
    """Bytes a rank sends per byte of buffer in a ring all-reduce: 2*(g-1)/g."""
    return 2 * (group - 1) / group


def dp_traffic_factor(zero_stage: int, dp: int, micro_batches: int = 1) -> float:
    """Bytes a rank sends per step per byte of its parameters in the DP exchange (module docstring)."""
    if dp == 1:
        return 0.0
    shard = (dp - 1) / dp
    m = micro_batches
    return {0: 2 * shard, 1: 3 * shard, 2: (m + 1) * shard, 3: 3 * m * shard}[zero_stage]


def stage_flops_per_micro_batch(
    *,
    layer_flop_params: int,
    layers: int,
    head_params: int,
    attention_width: int,
    seq_len: int,
    micro_batch: int,
    checkpointing: bool,
    cp: int = 1,
) -> float:
    """(6*N_layers + 12*layers*h*s) * b*s (x 4/3 with checkpointing) + 6*N_head * b*s; with context
    parallelism each rank runs b*s/cp of the tokens (and a/cp of the heads over the whole sequence)."""
    tokens = seq_len * micro_batch / cp
    decoder = float(6 * layer_flop_params * layers + 12 * layers * attention_width * seq_len) * tokens
    if checkpointing:
        decoder *= 4 / 3
    return decoder + 6 * head_params * tokens


def model_flops_per_token(*, flop_params: int, num_layers: int, attention_width: int, seq_len: int) -> float:
    """6*N + 12*L*h*s: the FLOPs MFU counts (no recomputation)."""
    return 6 * flop_params + 12 * num_layers * attention_width * seq_len


def tp_bytes_per_micro_batch(
    *,
    layers: int,
    tp: int,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    width: int,
    checkpointing: bool,
    forward_allreduces: float = 2,
    backward_allreduces: float = 5,
    grad_allreduce_params: float = 0,
    forward_gather_width: float = 0,
    backward_gather_width: float = 0,
    sequence_parallel: bool = False,
    sequence_params: float = 0,
    routing_allreduce_width: float = 0,
) -> float:
    """Decoder layers: without sequence parallelism, (exits x (2 with checkpointing, else 1) + entries)
    all-reduces of b*s*h; with it, (entries + exits) x (3 with checkpointing, else 2) all-gathers or
    reduce-scatters of b*s*h; all-reduces of b*s*`routing_allreduce_width` fp32 routing weights backward and
    of the gradients of `grad_allreduce_params` TP-replicated parameters per layer (and `sequence_params`
    with sequence parallelism), 2*(t-1)/t of each all-reduce sent and (t-1)/t of each half; plus all-gathers
    of b*s*(forward width, again with checkpointing, + backward width)."""
    if tp == 1:
        return 0.0
    recompute = 2 if checkpointing else 1
    tokens = seq_len * micro_batch
    half = (tp - 1) / tp
    gathered = (forward_gather_width * recompute + backward_gather_width) * tokens * width
    params = grad_allreduce_params + (sequence_params if sequence_parallel else 0)
    reduced = params * width + routing_allreduce_width * tokens * 4
    if sequence_parallel:
        halves = (backward_allreduces + forward_allreduces) * (recompute + 1)
        gathered += halves * tokens * hidden * width
    else:
        reduced += (forward_allreduces * recompute + backward_allreduces) * tokens * hidden * width
    return layers * (ring_allreduce_factor(tp) * reduced + half * gathered)


def ep_bytes_per_micro_batch(
    *,
    moe_layers: int,
    tp: int,
    ep: int,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    width: int,
    experts_per_token: int,
    checkpointing: bool,
) -> float:
    """All-to-all rows a rank sends over its EP group for `moe_layers` MoE layers: its TP slot's routes
    (b*s*k/t), the (ep-1)/ep of them whose experts sit on other EP ranks, h values each, out and back, in the
    forward, the backward and the recomputation."""
    if ep == 1:
        return 0.0
    rows = seq_len * micro_batch * experts_per_token / tp * (ep - 1) / ep
    exchanges = 2 * ((2 if checkpointing else 1) + 1)
    return moe_layers * exchanges * rows * hidden * width


def tp_edge_bytes_per_micro_batch(
    *,
    first: bool,
    last: bool,
    tp: int,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    width: int,
    sequence_parallel: bool = False,
    final_norm: int = 0,
) -> float:
    """The vocab-parallel ends: the embedding's partial lookups all-reduced forward (first stage; with
    sequence parallelism reduce-scattered, and the gradient all-gathered: the same bytes); the head's input
    gradient all-reduced backward (with sequence parallelism the input all-gathered forward and the gradient
    reduce-scattered) and the cross-entropy's max, sum of exponentials and target logit, three fp32
    all-reduces of b*s (last stage); with sequence parallelism the final norm's `final_norm` parameters'
    gradient too."""
    if tp == 1:
        return 0.0
    tokens = seq_len * micro_batch
    buffer = (tokens * hidden * width if first else 0) + (tokens * hidden * width + 3 * tokens * 4 if last else 0)
    if sequence_parallel and last:
        buffer += final_norm * width
    return ring_allreduce_factor(tp) * buffer


def tp_latency_steps_per_micro_batch(
    shape: ModelShape, *, layers: int, tp: int, first: bool, last: bool, checkpointing: bool, sequence_parallel: bool
) -> float:
    """Ring latency steps of the TP calls one rank makes per micro-batch, as the engine issues them (counted
    on the tiny Llama at tp 2 by `scripts.bench.counting`: 60 steps, this count): an all-reduce takes
    2(t-1) steps, an all-gather or reduce-scatter t-1. Per layer: the entries and exits of
    `tp_bytes_per_micro_batch` (with sequence parallelism each a half, forward and backward), one all-reduce
    per gradient-summed tensor (q/k norms; with sequence parallelism the norms and row biases too), the
    gathers and the routing weights' all-reduce. The ends: the embedding (first stage: one all-reduce, with
    sequence parallelism a reduce-scatter and its all-gather backward), the head's input (last stage: one
    all-reduce backward, with sequence parallelism an all-gather and its reduce-scatter), the cross-entropy's
    three all-reduces, and with sequence parallelism the final norm's gradient."""
    if tp == 1:
        return 0.0
    full, half = 2 * (tp - 1), tp - 1
    recompute = 2 if checkpointing else 1
    grads, seq, fwd_gathers, bwd_gathers = shape.tp_call_counts
    entries = shape.tp_forward_allreduces * recompute + shape.tp_backward_allreduces
    if sequence_parallel:
        exits = (shape.tp_forward_allreduces + shape.tp_backward_allreduces) * (recompute + 1) * half
        reduced = (grads + seq) * full
    else:
        exits = entries * full
        reduced = grads * full
    gathers = (fwd_gathers * recompute + bwd_gathers) * half
    routing = full if shape.tp_routing_allreduce_width else 0.0
    per_layer = exits + reduced + gathers + routing
    ends = 0.0
    if first:
        ends += 2 * half if sequence_parallel else full
    if last:
        ends += 2 * half if sequence_parallel else full
        ends += 3 * full + (full if sequence_parallel and shape.final_norm else 0)
    return layers * per_layer + ends


def p2p_bytes_per_micro_batch(
    *, seq_len: int, micro_batch: int, hidden: int, width: int, shards: int = 1, token_ids: bool = True
) -> tuple[int, int]:
    """(forward, backward) message bytes one rank sends across one stage boundary: hidden states plus int64
    token ids forward (`token_ids`), the hidden states' gradient backward; with sequence parallelism (`shards`
    = tp) the hidden states are this rank's 1/tp of the sequence."""
    activations = seq_len * micro_batch * hidden * width // shards
    return activations + (seq_len * micro_batch * 8 if token_ids else 0), activations
