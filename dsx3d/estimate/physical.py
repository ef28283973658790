"""The physical time of one pipeline stage's micro-batch: each GEMM, attention, memory-bound pass and collective of its layers, on a `DeviceProfile`.

Per decoder layer and micro-batch, with T = b*s/cp tokens on a rank, t = tp, h hidden, a and kv heads of
width d, f the MLP width (`dsx3d.estimate.kernels` times every piece):
  matmul: q/k/v (T x h times h x (a+2kv)d/t), the output projection ((a d/t) x h), the MLP (gate+up
    h x 2f/t and down f/t x h; not gated: h x f/t and f/t x h); each forward GEMM, its input-gradient and
    its weight-gradient GEMM. MoE layers: the tokens' routes spread over the rank's E/(t*ep) experts,
    a batched GEMM of T*k*ep/E rows per expert. A bare parameter count (no shape): one T x h x N GEMM with
    N = layer FLOP parameters / h / t.
  attention: fused (flash): 4*T*s*a*d/t FLOPs forward at attention_efficiency, 2.5x that backward; eager:
    the two batched GEMMs QK^T and AV per head, plus the softmax over (a/t)*s scores per token, 2w bytes
    read and written forward (scale, mask, softmax) and 3w backward; with `attention_dropout` 2w + 1 more
    each way (the dropped probabilities and their mask), and the two residual dropouts on h.
  elementwise: memory-bound passes per token: norms and residual adds, 10 values of h read or written
    forward (h/t with sequence parallelism), the MLP activation (3f/t gated, 2f/t not), x w bytes; the
    backward moves twice the forward's bytes; 12 kernels forward, 24 backward.
  recompute: with full activation checkpointing the forward again (before the backward).
  tp, cp, ep: the bytes `dsx3d.estimate.timing` counts, at the bandwidth of the link the group crosses,
    plus the latency of each call (2(g-1) steps for an all-reduce, g-1 for a half; TP's calls as the engine
    issues them, `timing.tp_latency_steps_per_micro_batch`).
  pp: one message forward (with `token_ids_sent`, two sends: the hidden states and the token ids) and one
    backward per boundary and virtual stage (blocking: on the critical path);
    with `scatter_gather` each TP rank sends 1/t of it and the receiver all-gathers the pieces over NVLink.
  head (last stage): the vocab GEMM (T x h x V/t), its backward, and the cross-entropy's passes over the
    T x V/t logits (4 forward, 4 backward fp32 values per logit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsx3d.estimate import context_parallel, kernels, memory, schedules, timing
from dsx3d.estimate.devices import DeviceProfile
from dsx3d.estimate.inputs import Setup, sequence_parallel
from dsx3d.models.shape import ModelShape
from dsx3d.plan.layout import Layout

HIDDEN_PASSES = 10
"""Values of h per token the forward's norms and residual adds read or write (2 norms x 2, 2 adds x 3)."""


@dataclass
class StageTerms:
    """Seconds of one micro-batch on one rank of a stage, by term; forward and backward parts apart."""

    forward: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)
    """Bytes one rank sends per micro-batch by group type."""
    algorithms: dict[str, str] = field(default_factory=dict)

    def add(self, term: str, forward: float, backward: float) -> None:
        self.forward[term] = self.forward.get(term, 0.0) + forward
        self.backward[term] = self.backward.get(term, 0.0) + backward

    @property
    def forward_s(self) -> float:
        return sum(self.forward.values())

    @property
    def backward_s(self) -> float:
        return sum(self.backward.values())

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def by_term(self) -> dict[str, float]:
        keys = list(dict.fromkeys([*self.forward, *self.backward]))
        return {k: self.forward.get(k, 0.0) + self.backward.get(k, 0.0) for k in keys}


def _linear(terms: StageTerms, m: float, k: float, n: float, dev: DeviceProfile, w: int, times: float = 1) -> None:
    forward, backward = kernels.matmul_training_seconds(m, k, n, dev, w)
    terms.add("matmul", forward * times, backward * times)


def _layer_compute(
    terms: StageTerms, shape: ModelShape, setup: Setup, dev: DeviceProfile, layer_flop_params: float, moe: bool
) -> None:
    """One decoder layer's GEMMs, attention and memory-bound passes (module docstring)."""
    t, w = setup.tp, memory.dtype_bytes(setup.dtype)
    tokens = setup.micro_batch_size * setup.local_seq_len
    h, s = shape.hidden_size, setup.seq_len
    if h == 0 or shape.ffn_size == 0:  # a bare parameter count: one GEMM of the layer's FLOP parameters
        width = max(h, 1024)
        _linear(terms, tokens, width, layer_flop_params / width / t, dev, w)
        if h:
            flops = 4 * tokens * s * shape.attention_width / t
            terms.add("attention", *kernels.flash_attention_seconds(flops, dev))
        return
    a, kv, d = shape.num_heads, shape.num_kv_heads or shape.num_heads, shape.head_dim or h // max(shape.num_heads, 1)
    _linear(terms, tokens, h, (a + 2 * kv) * d / t, dev, w)
    _linear(terms, tokens, a * d / t, h, dev, w)
    f = shape.ffn_size
    if moe and shape.num_experts:
        local = max(shape.num_experts / (t * setup.ep), 1.0)
        rows = tokens * shape.experts_per_token * setup.ep / shape.num_experts
        up = (2 if shape.gated_mlp else 1) * f
        for k, n in ((h, up), (f, h)):
            fwd = kernels.gemm_seconds(rows, k, n, dev, w, batch=local)
            bwd = kernels.gemm_seconds(rows, n, k, dev, w, batch=local) + kernels.gemm_seconds(k, rows, n, dev, w, batch=local)
            terms.add("matmul", fwd, bwd)
        f_local = f * shape.experts_per_token / t
    else:
        _linear(terms, tokens, h, (2 if shape.gated_mlp else 1) * f / t, dev, w)
        _linear(terms, tokens, f / t, h, dev, w)
        f_local = f / t
    heads = a / (t * setup.cp) * setup.micro_batch_size  # attention runs on a/(t*cp) heads of whole sequences
    if setup.flash_attention:
        flops = 4 * heads * s * s * d
        terms.add("attention", *kernels.flash_attention_seconds(flops, dev))
    else:
        qk = kernels.gemm_seconds(s, d, s, dev, w, batch=heads)
        av = kernels.gemm_seconds(s, s, d, dev, w, batch=heads)
        scores = heads * s * s
        drop = (2 * w + 1) * scores if setup.attention_dropout else 0.0  # the probabilities and their mask
        terms.add(
            "attention",
            qk + av + kernels.memory_seconds(2 * w * scores + drop, dev, 3),
            2 * (qk + av) + kernels.memory_seconds(3 * w * scores + drop, dev, 4),
        )
    hidden = h / t if sequence_parallel(shape, setup) else h
    passes = HIDDEN_PASSES + (2 * (2 + 1 / w) if setup.attention_dropout else 0)  # residual dropouts and masks
    nbytes = tokens * w * (passes * hidden + (3 if shape.gated_mlp else 2) * f_local)
    terms.add("elementwise", kernels.memory_seconds(nbytes, dev, 12), kernels.memory_seconds(2 * nbytes, dev, 24))


def _head(terms: StageTerms, shape: ModelShape, setup: Setup, dev: DeviceProfile) -> None:
    t, w = setup.tp, memory.dtype_bytes(setup.dtype)
    tokens = setup.micro_batch_size * setup.local_seq_len
    if shape.hidden_size == 0 or shape.vocab_size == 0:
        _linear(terms, tokens, 1024, shape.head / 1024 / t, dev, w)
        return
    before = dict(terms.forward), dict(terms.backward)
    _linear(terms, tokens, shape.hidden_size, shape.vocab_size / t, dev, w)
    logits = tokens * shape.vocab_size / t
    forward = kernels.memory_seconds(16 * logits, dev, 4)
    terms.add("matmul", forward, forward)
    # book the head apart from the decoder's GEMMs
    for part, old in zip((terms.forward, terms.backward), before, strict=True):
        part["head"] = part.get("head", 0.0) + part["matmul"] - old.get("matmul", 0.0)
        part["matmul"] = old.get("matmul", 0.0)


def stage_terms(
    shape: ModelShape,
    setup: Setup,
    dev: DeviceProfile,
    gpus_per_node: int,
    stage: int,
    first: int,
    layers: int,
) -> StageTerms:
    """Seconds of one micro-batch on one rank of `stage` (decoder layers [first, first + layers)), by term."""
    terms = StageTerms()
    for layer in shape.layer_shapes(first, layers):
        _layer_compute(terms, shape, setup, dev, layer.flop_params, layer.moe)
    if setup.activation_checkpointing:
        terms.add("recompute", 0.0, sum(terms.forward.values()))
    last = stage == schedules.head_stage(setup.schedule, setup.pp)
    if last:
        _head(terms, shape, setup, dev)
    _communication(terms, shape, setup, dev, gpus_per_node, stage, layers, shape.moe_layers(first, layers))
    return terms


def _communication(
    terms: StageTerms,
    shape: ModelShape,
    setup: Setup,
    dev: DeviceProfile,
    gpus_per_node: int,
    stage: int,
    layers: int,
    moe_layers: int,
) -> None:
    s, b, t = setup.local_seq_len, setup.micro_batch_size, setup.tp
    sp = sequence_parallel(shape, setup)
    w = memory.dtype_bytes(setup.dtype)
    place = Layout(dp=setup.dp, tp=t, pp=setup.pp, gpus_per_node=gpus_per_node, ep=setup.ep, cp=setup.cp)
    last = stage == schedules.head_stage(setup.schedule, setup.pp)
    ckpt = setup.activation_checkpointing
    if t > 1:
        sent = timing.tp_bytes_per_micro_batch(
            layers=layers, tp=t, seq_len=s, micro_batch=b, hidden=shape.hidden_size, width=w, checkpointing=ckpt,
            forward_allreduces=shape.tp_forward_allreduces, backward_allreduces=shape.tp_backward_allreduces,
            grad_allreduce_params=shape.tp_grad_allreduce_params, forward_gather_width=shape.tp_forward_gather_width,
            backward_gather_width=shape.tp_backward_gather_width, sequence_parallel=sp,
            sequence_params=shape.tp_sequence_params, routing_allreduce_width=shape.tp_routing_allreduce_width,
        )
        if shape.hidden_size:
            sent += timing.tp_edge_bytes_per_micro_batch(
                first=stage == 0, last=last, tp=t, seq_len=s, micro_batch=b, hidden=shape.hidden_size, width=w,
                sequence_parallel=sp, final_norm=shape.final_norm,
            )
        fwd_calls = shape.tp_forward_allreduces * (2 if ckpt else 1)
        bwd_calls = shape.tp_backward_allreduces
        steps = timing.tp_latency_steps_per_micro_batch(
            shape, layers=layers, tp=t, first=stage == 0, last=last, checkpointing=ckpt, sequence_parallel=sp
        )
        seconds = kernels.sent_seconds(sent, steps, 1, dev, place.tp_crosses_node())
        share = fwd_calls / (fwd_calls + bwd_calls)
        terms.add("tp", seconds * share * (1 / 2 if ckpt else 1), seconds * (1 - share * (1 / 2 if ckpt else 1)))
        terms.sent["tp"] = sent
        terms.algorithms["tp"] = "ring" + (" (reduce-scatter/all-gather)" if sp else "")
    if setup.cp > 1:
        sent = context_parallel.alltoall_bytes_per_micro_batch(
            layers=layers, cp=setup.cp, tp=t, seq_len=setup.seq_len, micro_batch=b, num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, width=w, checkpointing=ckpt,
        )
        seconds = kernels.sent_seconds(sent, 4 * layers * (3 if ckpt else 2), setup.cp - 1, dev, place.cp_crosses_node())
        terms.add("cp", seconds / (3 if ckpt else 2), seconds * (1 - 1 / (3 if ckpt else 2)))
        terms.sent["cp"] = sent
    if setup.ep > 1:
        sent = timing.ep_bytes_per_micro_batch(
            moe_layers=moe_layers, tp=t, ep=setup.ep, seq_len=s, micro_batch=b, hidden=shape.hidden_size, width=w,
            experts_per_token=shape.experts_per_token, checkpointing=ckpt,
        )
        exchanges = 2 * ((2 if ckpt else 1) + 1)
        seconds = kernels.sent_seconds(sent, exchanges * moe_layers, setup.ep - 1, dev, place.ep_crosses_node())
        terms.add("ep", seconds / 3, seconds * 2 / 3)
        terms.sent["ep"] = sent
    if setup.pp > 1 and shape.hidden_size:
        split = t if sp or setup.scatter_gather else 1
        forward_msg, backward_msg = timing.p2p_bytes_per_micro_batch(
            seq_len=s, micro_batch=b, hidden=shape.hidden_size, width=w, shards=split, token_ids=setup.token_ids_sent
        )
        v = max(setup.virtual_stages, 1)
        if setup.scatter_gather and not sp and t > 1:  # the receiver all-gathers the t pieces inside the node
            gather = kernels.gather_seconds(forward_msg * t, t, dev, place.tp_crosses_node())
            terms.add("pp", v * gather if stage > 0 or v > 1 else 0.0, v * gather if not last or v > 1 else 0.0)
        fwd = 0.0 if last and v == 1 else v * kernels.p2p_seconds(
            forward_msg, dev, place.boundary_crosses_node(min(stage, setup.pp - 2)), 2 if setup.token_ids_sent else 1
        )
        bwd = 0.0 if stage == 0 and v == 1 else v * kernels.p2p_seconds(
            backward_msg, dev, place.boundary_crosses_node(max(stage - 1, 0))
        )
        terms.add("pp", fwd, bwd)
        terms.sent["pp"] = v * ((0 if last and v == 1 else forward_msg) + (0 if stage == 0 and v == 1 else backward_msg))
