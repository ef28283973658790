"""Per-device memory: model states after ZeRO, and activations of a 1F1B pipeline stage.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and 5): mixed-precision Adam holds, per parameter,
2 bytes of 16-bit weights, 2 bytes of 16-bit gradients and K = 12 bytes of optimizer states (fp32 master
weights, momentum, variance). Stage 1 divides the K bytes by dp, stage 2 also the gradients, stage 3 also
the weights:

    baseline (2 + 2 + K) * N,  P_os 4N + K*N/dp,  P_os+g 2N + (2 + K)*N/dp,  P_os+g+p (4 + K)*N/dp

fp32 training (our choice, matching what DeepSpeed does): 4 bytes weights + 4 bytes gradients + 8 bytes of
Adam moments without ZeRO; with ZeRO >= 1 DeepSpeed's optimizer keeps its own fp32 copy of the partition
even when the model is fp32 (measured), so K = 12 there too. `fp32_grad_accum` adds the 4 bytes per
parameter of the unsharded fp32 gradient buffer DeepSpeed's BF16_Optimizer keeps (bf16 + ZeRO-1 with
`data_types.grad_accum_dtype: fp32`); the paper's model leaves it out.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Sec. 4, eq. 2 and the TP variant): one transformer layer keeps, per micro-batch, in 16-bit

    s*b*h*(34 + 5*a*s/h)  bytes,  and with tensor parallelism t (no sequence parallelism)
    s*b*h*(10 + 24/t + 5*a*s/(h*t))

(the 10*s*b*h of norm inputs and dropout masks outside the TP regions stays replicated; the rest is
split). `flash_attention` drops the 5*a*s/h term (the s x s scores a fused kernel never stores). fp32
scales everything by 2 (an approximation: dropout masks stay 1 byte). Full activation checkpointing keeps
only each layer's 2*s*b*h input plus one layer's working set during its recomputation. The last stage
adds the head: the final norm and head inputs (2 * 2*s*b*h) and fp32 logits for the loss, 4*s*b*V/t.
A synchronous 1F1B pipeline holds min(pp - stage, m) micro-batches in flight on a stage (Narayanan et
al. 2021), so stage 0 holds the most.

MoE layers. Experts are split over tp x ep ranks and their optimizer states partitioned over the
expert-data-parallel group (dp / ep ranks) instead of dp. In an MoE layer the dense MLP's share of the
activations (its input and dropout mask, 3*s*b*h, and the 16*s*b*h/t of its 4h activations) is replaced by
what HF's MoE block saves for backward, per token: the router's input (h values) and about 3.5*E fp32
values (logits, probabilities, the top-k picks), and per route a rank runs (k / t of them per token on
average, however they spread over EP ranks) the expert's input and weighted output (2h) and its gate/up
output, activation and product (4I), plus, when the experts are split (tp x ep > 1), the route's row as
dsx3d gathers it before the family's kernel gathers it again (h). Measured on one Qwen3-MoE block alone
(scripts/bench/moe.py's model, h = I = 128, E = 8, k = 2), values per token over h: 13.2 unsplit (this
model: 13.2), 8.2 at tp 2 (8.2), 15.3 at ep 2 (15.2: each EP rank runs the routes of two ranks' tokens to
half the experts), 8.2 at tp 2 x ep 2 (8.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsx3d.errors import UserError
from dsx3d.models.shape import ModelShape, ParamCount

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
    if fp32_grad_accum and dtype != "fp32":
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


def stage_params(shape: ModelShape, layers: list[int]) -> list[ParamCount]:
    """Parameters of each stage: its decoder layers, the embedding on stage 0, final norm and head on the
    last. A tied embedding/head lives on both end stages when pp > 1 (both hold a copy), once when pp == 1."""
    pp = len(layers)
    result = []
    first = 0
    for stage, n in enumerate(layers):
        count = shape.layers_params(first, n)
        first += n
        if stage == 0:
            count += ParamCount(sharded=shape.embedding)
        if stage == pp - 1:
            count += ParamCount(replicated=shape.final_norm)
            if not (shape.tie_word_embeddings and pp == 1):
                count += ParamCount(sharded=shape.head)
        result.append(count)
    return result


def layer_activation_bytes(
    shape: ModelShape,
    *,
    seq_len: int,
    micro_batch: int,
    tp: int,
    dtype: str,
    flash_attention: bool = False,
    moe: bool = False,
    ep: int = 1,
) -> float:
    """Korthikanti eq. 2 with TP: s*b*h*(10 + 24/t + 5*a*s/(h*t)), scaled by bytes/2 for fp32; for an MoE
    layer the dense MLP's 3 + 16/t is replaced by the router and experts (module docstring)."""
    s, b, h, a = seq_len, micro_batch, shape.hidden_size, shape.num_heads
    if h == 0:
        return 0.0
    per_token_width = 10 + 24 / tp + (0 if flash_attention else 5 * a * s / (h * tp))
    if moe:
        per_token_width -= 3 + 16 / tp
    total = s * b * h * per_token_width * dtype_bytes(dtype) / 2
    if moe:
        routes = shape.experts_per_token / tp
        per_route = (3 if tp * ep > 1 else 2) * h + 4 * shape.expert_width
        per_token = (h + routes * per_route) * dtype_bytes(dtype)
        total += s * b * (per_token + 3.5 * shape.num_experts * 4)
    return total


def head_activation_bytes(shape: ModelShape, *, seq_len: int, micro_batch: int, tp: int, dtype: str) -> float:
    """The last stage's extra: final-norm and head inputs (2 * s*b*h at the dtype width) and fp32 logits
    for the cross-entropy, 4*s*b*V/t (Korthikanti Sec. 4.3)."""
    s, b = seq_len, micro_batch
    return 2 * s * b * shape.hidden_size * dtype_bytes(dtype) + 4 * s * b * shape.vocab_size / tp


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
    moe_layers: int = 0,
    ep: int = 1,
) -> float:
    """Peak activation bytes on one device of `stage` (see the module docstring for the model); `moe_layers`
    of its `layers` are MoE layers."""

    def one(moe: bool) -> float:
        return layer_activation_bytes(
            shape,
            seq_len=seq_len,
            micro_batch=micro_batch,
            tp=tp,
            dtype=dtype,
            flash_attention=flash_attention,
            moe=moe,
            ep=ep,
        )

    one_layer = max(one(False) if layers > moe_layers else 0.0, one(True) if moe_layers else 0.0)
    all_layers = (layers - moe_layers) * one(False) + (moe_layers * one(True) if moe_layers else 0.0)
    held = in_flight(stage, pp, micro_batches)
    if checkpointing:
        layer_input = seq_len * micro_batch * shape.hidden_size * dtype_bytes(dtype)
        total = held * layers * layer_input + (one_layer if layers else 0.0)
    else:
        total = held * all_layers
    if stage == pp - 1 and shape.hidden_size:
        total += head_activation_bytes(shape, seq_len=seq_len, micro_batch=micro_batch, tp=tp, dtype=dtype)
    return total
