"""Per-device memory: model states after ZeRO, the activations a 1F1B pipeline stage holds, and the
transient buffers of the backward pass and the optimizer step, as dsx3d's engine allocates them.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and 5): mixed-precision Adam holds, per parameter,
2 bytes of 16-bit weights, 2 bytes of 16-bit gradients and K = 12 bytes of optimizer states (fp32 master
weights, momentum, variance). Stage 1 divides the K bytes by dp, stage 2 also the gradients, stage 3 also
the weights:

    baseline (2 + 2 + K) * N,  P_os 4N + K*N/dp,  P_os+g 2N + (2 + K)*N/dp,  P_os+g+p (4 + K)*N/dp

fp32 training (our choice, matching what DeepSpeed does): 4 bytes weights + 4 bytes gradients + 8 bytes of
Adam moments without ZeRO; with ZeRO >= 1 DeepSpeed's optimizer keeps its own fp32 copy of the partition
even when the model is fp32, so K = 12 there too. `fp32_grad_accum` adds the 4 bytes per
parameter of the unsharded fp32 gradient buffer DeepSpeed's BF16_Optimizer keeps (bf16 + ZeRO-1 with
`data_types.grad_accum_dtype: fp32`); the paper's model leaves it out. Gradients exist from a step's first
backward to its optimizer step (ZeRO frees them there).

Activations, per token of a micro-batch, counted from what a Hugging Face decoder layer saves for backward
(a saved-tensor hook on a Llama layer counts exactly the sum below), model dtype width w (2 or 4 bytes), t = tp:
  - two norms: RMSNorm (HF computes it in fp32) keeps its fp32 input, the fp32 normalised values and
    1/rms: 8h + 4 bytes each; LayerNorm its input and mean/rstd: w*h + 8;
  - the normalised inputs of attention and MLP, saved by their first projections: 2*w*h. With sequence
    parallelism the norms run on this rank's s/t tokens (h -> h/t above) but these two stay whole: dsx3d
    keeps the all-gathered input rather than gathering it again in the backward (Megatron's choice, which
    costs one more all-gather per region: 5 instead of 4 all-reduce equivalents per layer);
  - attention with a fused kernel (sdpa/flash): q, k, v, its output and the fp32 log-sum-exp,
    w*(2*a*d + 2*kv*d)/t + 4*a/t; without (`flash_attention` False, HF "eager"): also the fp32 softmax
    probabilities and their cast, (4 + w)*a*s/t, with k and v repeated to all heads;
  - the MLP: gate, activation, up and their product, 4*w*f/t (gated; fc1 and activation, 2*w*f/t, not
    gated), times top-k for MoE.
Korthikanti et al. 2022 (Sec. 4, eq. 2: s*b*h*(34 + 5*a*s/h) bytes in 16-bit, 10*s*b*h of it outside the TP
regions) is the fallback when the MLP width is unknown (a bare parameter count). Full activation
checkpointing keeps each layer's input (w*h) plus one layer's working set during its recomputation.

The pipeline holds, per micro-batch in flight (min(pp - stage, m) in a synchronous 1F1B schedule,
Narayanan et al. 2021), each stage's input and output (w*h, with sequence parallelism w*h/t), and keeps
one receive buffer for activations and one for their gradients. The last stage adds the final norm, the
head's input (w*h, whole), its vocab-sharded logits (w*V/t, kept by DeepSpeed until the backward) and the
vocab-parallel cross-entropy: its fp32 softmax (4V/t, saved) and, transiently, the shifted logits and their
exponentials (8V/t; in bf16 also the fp32 copy of the logits, 4V/t). The first stage keeps the token ids
and the vocab-shard masks (17 bytes per token).

Transients (what a plan must leave room for on top of states and activations), with ZeRO >= 1 (DeepSpeed's
stage_1_and_2.py, fp32 buffers): the gradient bucket the ZeRO optimizer allocates at the first backward of
a step (`reduce_bucket_size` elements, DeepSpeed's default 5e8: 2 GB), another one while the pipeline
engine reduces the gradients, the flat fp32 gradient partition the optimizer step copies the gradients
into (4N/dp; grads then freed), and the temporaries of torch's AdamW step on that partition (sqrt of the
second moment and its quotient: 1 x 4N/dp with the foreach kernels of GPUs, 2 x on CPU). The peak of a
stage is the larger of its backward phase (states + activations + the first bucket) and its optimizer
phase (weights + optimizer states + the largest of: gradients and two buckets, gradients and the flat
partition, the flat partition and AdamW's temporaries).

MoE layers. Experts are split over tp x ep ranks and their optimizer states partitioned over the
expert-data-parallel group (dp / ep ranks) instead of dp. In an MoE layer the dense MLP's activations are
replaced by what HF's MoE block saves for backward, per token: about 3.5*E fp32 values (router logits,
probabilities, the top-k picks; the router's input is the MLP entry above), and per route a rank runs (k / t
of them per token on average, however they spread over EP ranks) the expert's input and weighted output
(2h) and its gate/up output, activation and product (4I), plus, when the experts are split (tp x ep > 1),
the route's row as dsx3d gathers it before the family's kernel gathers it again (h). At ep > 1 each EP rank runs the
routes of ep ranks' tokens to its share of the experts. With the Korthikanti fallback the dense MLP's share (3 + 16/t)*s*b*h is
replaced the same way.

Context parallelism (cp) and the tiled loss: `dsx3d.estimate.context_parallel` (per-token terms at s/cp tokens, the
score matrix per head shard, ZeRO over dp x cp, the last stage's logits whole or one tile at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsx3d.errors import UserError
from dsx3d.estimate.context_parallel import kv_heads_held, logits_bytes
from dsx3d.models.shape import ModelShape, ParamCount
from dsx3d.recipe.ds_optimizer import keeps_fp32_grad_buffer

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAM_K_MIXED = 12  # fp32 master weights + momentum + variance


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise UserError.single("dtype", dtype, "unknown dtype", f"use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class StateBytes:
    """Bytes one device holds for its parameters, their gradients and the optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    num_params: float, *, dp: int, zero_stage: int, dtype: str = "bf16", fp32_grad_accum: bool = False
) -> StateBytes:
    """Model states for `num_params` parameters replicated over `dp` ranks (ZeRO paper, Sec. 5)."""
    if zero_stage not in (0, 1, 2, 3):
        raise UserError.single("zero_stage", zero_stage, "ZeRO stage must be 0, 1, 2 or 3", "pick 0-3")
    width = dtype_bytes(dtype)
    if dtype == "fp32":
        optimizer_k = 12 if zero_stage >= 1 else 8
    else:
        optimizer_k = ADAM_K_MIXED
    params = width * num_params / (dp if zero_stage >= 3 else 1)
    grads = width * num_params / (dp if zero_stage >= 2 else 1)
    if _fp32_buffer(dtype, zero_stage, fp32_grad_accum):
        # BF16_Optimizer's fp32 accumulation buffer (ZeRO-2/3 keep their own fp32 partition, a transient here)
        grads += 4 * num_params
    optimizer = optimizer_k * num_params / (dp if zero_stage >= 1 else 1)
    return StateBytes(params, grads, optimizer)


def split_layers(num_layers: int, pp: int) -> list[int]:
    """Decoder layers per stage, as even as possible. Extra layers go to the inner stages first (they
    carry neither the embedding nor the head), then to stage 0, then to the last stage."""
    _check_stages(num_layers, pp)
    base, extra = divmod(num_layers, pp)
    order = list(range(1, pp - 1)) + [0, pp - 1] if pp > 1 else [0]
    counts = [base] * pp
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def _check_stages(num_layers: int, pp: int) -> None:
    if pp > num_layers:
        raise UserError.single(
            "parallel.pp", pp, f"more stages than the model's {num_layers} layers", f"use pp <= {num_layers}"
        )


def stage_params(shape: ModelShape, layers: list[int], head_stage: int | None = None) -> list[ParamCount]:
    """Parameters of each stage: its decoder layers, the embedding on stage 0, final norm and head on
    `head_stage` (default the last). A tied embedding/head lives on both end stages when they differ (both hold
    a copy), once when one rank holds both (pp == 1, V-shaped chunks)."""
    pp = len(layers)
    head_stage = pp - 1 if head_stage is None else head_stage
    result = []
    first = 0
    for stage, n in enumerate(layers):
        count = shape.layers_params(first, n)
        first += n
        if stage == 0:
            count += ParamCount(sharded=shape.embedding)
        if stage == head_stage:
            count += ParamCount(replicated=shape.final_norm)
            if not (shape.tie_word_embeddings and head_stage == 0):
                count += ParamCount(sharded=shape.head)
        result.append(count)
    return result


def _norm_bytes(shape: ModelShape, width: float, h: float) -> float:
    """What one norm keeps per token for `h` values (module docstring)."""
    return 8 * h + 4 if shape.rms_norm else width * h + 8


def layer_activation_bytes(
    shape: ModelShape,
    *,
    seq_len: int,
    micro_batch: int,
    tp: int,
    dtype: str,
    flash_attention: bool = False,
    sequence_parallel: bool = False,
    moe: bool = False,
    ep: int = 1,
    cp: int = 1,
) -> float:
    """Bytes one decoder layer keeps for backward per micro-batch on one TP rank (module docstring); with an
    unknown MLP width, Korthikanti eq. 2 with TP: s*b*h*(10 + 24/t + 5*a*s/(h*t)) (10/t with sequence
    parallelism), scaled by bytes/2 for fp32. `moe`: the layer's MLP is routed experts over tp x ep. `cp`:
    each rank keeps s/cp tokens of every term, the scores a*s/t per local token (`dsx3d.estimate.context_parallel`)."""
    s, b, h, t = seq_len, micro_batch / cp, shape.hidden_size, tp
    w = dtype_bytes(dtype)
    if h == 0:
        return 0.0
    experts = 0.0
    if moe:
        routes = shape.experts_per_token / t
        per_route = (3 if t * ep > 1 else 2) * h + 4 * shape.expert_width
        experts = routes * per_route * w + 3.5 * shape.num_experts * 4
    if shape.ffn_size == 0:
        outside = 10 / t if sequence_parallel else 10
        per_token_width = outside + 24 / t + (0 if flash_attention else 5 * shape.num_heads * s / (h * t))
        if moe:
            per_token_width -= 2 + 16 / t  # the dense MLP's activations; its input (1 of the 3) stays
        return s * b * (h * per_token_width * w / 2 + experts)
    a, kv, d = shape.num_heads, kv_heads_held(shape.num_kv_heads, tp, cp), shape.head_dim
    norms = 2 * _norm_bytes(shape, w, h / t if sequence_parallel else h)
    entries = 2 * w * h
    attention = (w * (2 * a * d + 2 * kv * d) + 4 * a) / t
    if not flash_attention:
        attention += ((4 + w) * a * s + 2 * w * (a - kv) * d) / t
    mlp = experts if moe else (4 if shape.gated_mlp else 2) * w * shape.ffn_size / t
    return s * b * (norms + entries + attention + mlp)


def head_activation_bytes(
    shape: ModelShape,
    *,
    seq_len: int,
    micro_batch: int,
    tp: int,
    dtype: str,
    sequence_parallel: bool = False,
    cp: int = 1,
    loss_tile_tokens: int = 0,
) -> float:
    """The last stage's extra (module docstring): final norm, the head's whole input, the vocab-sharded
    logits, the cross-entropy's softmax and its transient buffers (one tile of them with `loss_tile_tokens`)."""
    tokens, h = seq_len * micro_batch / cp, shape.hidden_size
    w = dtype_bytes(dtype)
    norm = _norm_bytes(shape, w, h / tp if sequence_parallel else h)
    logits = logits_bytes(tokens=tokens, vocab_per_rank=shape.vocab_size / tp, width=w, tile_tokens=loss_tile_tokens)
    return tokens * (norm + w * h) + logits


def in_flight(stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at its peak: min(pp - stage, m)."""
    return min(pp - stage, micro_batches)


def stage_activation_bytes(
    shape: ModelShape,
    *,
    stage: int,
    layers: int,
    pp: int,
    micro_batches: int,
    seq_len: int,
    micro_batch: int,
    tp: int,
    dtype: str,
    checkpointing: bool,
    flash_attention: bool = False,
    sequence_parallel: bool = False,
    moe_layers: int = 0,
    ep: int = 1,
    held: int | None = None,
    cp: int = 1,
    loss_tile_tokens: int = 0,
    head_stage: int | None = None,
) -> float:
    """Peak activation bytes on one device of `stage` (see the module docstring for the model); `moe_layers`
    of its `layers` are MoE layers; `held`: micro-batches in flight (default 1F1B's, `in_flight`); `cp`:
    context parallelism (s/cp tokens per rank); `loss_tile_tokens`: the last stage's logits a tile at a time;
    `head_stage`: the rank holding the head and the loss (default the last)."""
    if shape.hidden_size == 0:
        return 0.0

    def one(moe: bool) -> float:
        return layer_activation_bytes(
            shape,
            seq_len=seq_len,
            micro_batch=micro_batch,
            tp=tp,
            dtype=dtype,
            flash_attention=flash_attention,
            sequence_parallel=sequence_parallel,
            moe=moe,
            ep=ep,
            cp=cp,
        )

    one_layer = max(one(False) if layers > moe_layers else 0.0, one(True) if moe_layers else 0.0)
    all_layers = (layers - moe_layers) * one(False) + (moe_layers * one(True) if moe_layers else 0.0)
    tokens = seq_len * micro_batch / cp
    hidden = tokens * shape.hidden_size * dtype_bytes(dtype) / (tp if sequence_parallel else 1)
    first, last = stage == 0, stage == (pp - 1 if head_stage is None else head_stage)
    held = in_flight(stage, pp, micro_batches) if held is None else held
    if checkpointing:
        per_micro_batch = layers * hidden
        total = one_layer if layers else 0.0
    else:
        per_micro_batch = all_layers
        total = 0.0
    per_micro_batch += (0 if first else hidden) + (0 if last else hidden)  # stage input and output
    per_micro_batch += 17 * tokens if first else 0  # token ids, local ids, vocab-shard mask
    total += held * per_micro_batch + (0 if first else hidden) + (0 if last else hidden)  # receive buffers
    if last:
        total += head_activation_bytes(
            shape,
            seq_len=seq_len,
            micro_batch=micro_batch,
            tp=tp,
            dtype=dtype,
            sequence_parallel=sequence_parallel,
            cp=cp,
            loss_tile_tokens=loss_tile_tokens,
        )
    return total


def optimizer_kind(*, zero_stage: int, dtype: str, fp32_grad_accum: bool) -> str:
    """Which DeepSpeed optimizer wrapper the engine runs: "bf16" (BF16_Optimizer: bf16 weights, fp32 gradient
    accumulation, ZeRO-1), "zero" (stage_1_and_2.py / ZeRO-3) or "torch" (ZeRO-0: torch's AdamW as is)."""
    if zero_stage == 0:
        return "torch"
    return "bf16" if _fp32_buffer(dtype, zero_stage, fp32_grad_accum) else "zero"


def _fp32_buffer(dtype: str, zero_stage: int, fp32_grad_accum: bool) -> bool:
    """Whether DeepSpeed picks BF16_Optimizer with its unsharded fp32 gradient buffer: bf16 with fp32
    accumulation at ZeRO-1 only (`dsx3d.recipe.ds_optimizer`); fp16 with ZeRO keeps DeepSpeed's ZeRO optimizer."""
    return keeps_fp32_grad_buffer(dtype, zero_stage, "fp32" if fp32_grad_accum else None, pipeline=False)


@dataclass(frozen=True)
class Transients:
    """Buffers beyond states and activations (module docstring), bytes on one device."""

    kind: str
    """`optimizer_kind`."""
    bucket: float = 0.0
    """One ZeRO gradient bucket (`reduce_bucket_size` fp32 elements); 0 for the other wrappers."""
    flat_partition: float = 0.0
    """The fp32 gradient partition the ZeRO optimizer step copies the gradients into; 0 for the other
    wrappers (they step on their own buffers)."""
    flat_16bit: float = 0.0
    """The 16-bit flat copy of 16-bit gradients made first (alive with the fp32 one for a moment)."""
    optimizer_step: float = 0.0
    """AdamW's temporaries on the partition."""


def transient_bytes(
    partition: float,
    *,
    zero_stage: int,
    dtype: str,
    fp32_grad_accum: bool,
    reduce_bucket_size: float,
    optimizer_temporaries: float,
) -> Transients:
    """`partition`: the parameters this rank's optimizer steps on (with ZeRO >= 1 its share of each group's
    parameters over that group's data-parallel ranks; without ZeRO all it holds)."""
    kind = optimizer_kind(zero_stage=zero_stage, dtype=dtype, fp32_grad_accum=fp32_grad_accum)
    adam = optimizer_temporaries * 4 * partition
    if kind != "zero":
        return Transients(kind, optimizer_step=adam)
    flat_16bit = dtype_bytes(dtype) * partition if dtype != "fp32" else 0.0
    return Transients(kind, 4 * reduce_bucket_size, 4 * partition, flat_16bit, adam)


def peak_bytes(
    states: StateBytes, activations: float, transients: Transients, *, pipelined: bool, lp_grads: float
) -> tuple[float, str]:
    """(peak bytes, "backward" or "optimizer"): the larger of a stage's two phases (module docstring).
    `lp_grads`: bytes of the 16-bit gradients the bf16 wrapper clears before its step."""
    backward = states.total + activations + transients.bucket
    if transients.kind == "torch":  # gradients stay through torch's step
        optimizer = states.total + transients.optimizer_step
    elif transients.kind == "bf16":  # steps on its fp32 gradient buffer, the 16-bit gradients cleared
        optimizer = states.total - lp_grads + transients.optimizer_step
    else:
        t = transients
        buckets = (2 if pipelined else 1) * t.bucket
        optimizer = (
            states.params
            + states.optimizer
            + max(
                states.grads + buckets,
                states.grads + t.flat_16bit + t.flat_partition,
                t.flat_partition + t.optimizer_step,
            )
        )
    return (backward, "backward") if backward >= optimizer else (optimizer, "optimizer")
