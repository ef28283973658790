"""A parity case: the model, layout, precision and steps to compare, its batches, and the tolerances each check allows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from dsx3d.pipeline.registry import DEFAULT_SCHEDULE
from dsx3d.plan.degrees import HasDegrees
from dsx3d.verify.bf16_roundoff import BF16_U

FP32_EPS = torch.finfo(torch.float32).eps


LOSS_TOL_FP32 = 1e-5


@dataclass
class Check:
    """One criterion's verdict: the worst value seen (as a fraction of what is allowed: <= 1 passes)."""

    name: str
    worst: float
    where: str
    ok: bool


@dataclass(frozen=True)
class Criteria:
    """Tolerances of one comparison (see the module docstring)."""

    loss_rtol: float
    """|loss_3d - loss_ref| <= loss_rtol * max(1, |loss_ref|), every step."""
    norm_rtol: float
    """|norm_3d - norm_ref| <= norm_rtol * max(1, norm_ref), every step."""
    grad_rtol: float
    """SGD: ||dW_3d - dW_ref|| <= grad_rtol * ||dW_ref|| + grad_floor * ||dW_ref(all tensors)||, per tensor and step."""
    grad_floor: float
    roundoff: float
    """AdamW: gradient round-off of a tensor, relative to its largest gradient element."""
    weight_atol: float
    """AdamW: plus this much per element, relative to max(1, |w|)."""
    stored_u: float = FP32_EPS / 2
    """Unit round-off of the dtype the 3D side stores its parameters in: each weight it hands back is rounded
    to within stored_u |w| (bf16: 2^-8; its fp32 master copy stays inside the optimizer)."""


CRITERIA = {
    "fp32": Criteria(
        loss_rtol=1e-5, norm_rtol=1e-5, grad_rtol=1e-4, grad_floor=1e-6, roundoff=1e-5, weight_atol=1e-6
    ),
    # bf16 compute against an fp32 reference: fp32's criterion (gradients are accumulated, clipped and applied
    # in fp32) plus what bf16 itself does to each compared quantity, measured on the reference
    # (dsx3d.verify.bf16_roundoff), plus each stored weight's rounding to bf16
    "bf16": Criteria(
        loss_rtol=1e-5, norm_rtol=1e-5, grad_rtol=1e-4, grad_floor=1e-6, roundoff=1e-5, weight_atol=1e-6,
        stored_u=BF16_U,
    ),
}


@dataclass
class ParityCase(HasDegrees):
    config: PretrainedConfig
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert parallelism (divides dp): MoE experts split over ep DP ranks, tokens exchanged all-to-all."""
    cp: int = 1
    """Context parallelism: every sequence split over cp ranks (Ulysses attention)."""
    steps: int = 3
    micro_batch_size: int = 2
    micro_batches: int = 2
    seq_len: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"
    """"adamw", or "sgd" (plain SGD: the weight change of a step is the gradient, see the module docstring)."""
    zero_stage: int = 1
    data: str = "random"
    """random tokens, or \"pattern\": sequences counting up from a random start (learnable, so losses fall)"""
    grad_clip: float = 1.0
    dtype: str = "fp32"
    seed: int = 0
    activation_checkpointing: bool = False
    loss_tile_tokens: int = 0
    """train.loss_tile_tokens: the last stage's logits and loss N tokens at a time (0: all at once)."""
    stage_layers: list[int] | None = None
    sequence_parallel: bool = True
    """parallel.sequence_parallel (takes effect with tp > 1)"""
    schedule: str = DEFAULT_SCHEDULE
    """parallel.schedule (with pp > 1): a name in `dsx3d.pipeline.registry`."""
    virtual_stages: int | None = None
    """parallel.virtual_stages: model chunks per rank (None: the schedule's own, `ScheduleSpec.virtual_stages`)."""
    zb_costs: tuple[float, float, float] | str | None = None
    """parallel.zb_costs: the F, B, W durations zb-h1's order is built for, or "auto" (measured)."""
    lora: dict[str, Any] | None = None
    """A recipe's model.lora section: both sides train peft LoRA adapters on the frozen model (the reference
    is `peft.get_peft_model` on the same HF model; only the adapters are compared)."""

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp


def make_batches(case: ParityCase) -> torch.Tensor:
    """(steps, B, seq_len) random token ids, fixed by the seed, without the config's padding token.

    HF initialises the padding token's embedding row to zero, and text does not carry padding as input. A
    sequence that starts with it keeps a hidden state of exactly zero through every layer of a model whose
    biases start at zero (causal attention sees only that position), and RMSNorm's gradient at zero is
    1/sqrt(eps): through GLM-4's four norms a layer (eps 1.6e-7) it overflows fp32 in plain HF itself. A drawn
    padding id is replaced by the next id."""
    g = torch.Generator().manual_seed(case.seed + 1)
    text = case.config.get_text_config()
    vocab = text.vocab_size
    if case.data == "pattern":
        start = torch.randint(0, vocab, (case.steps, case.global_batch, 1), generator=g)
        ids = (start + torch.arange(case.seq_len)) % vocab
    else:
        ids = torch.randint(0, vocab, (case.steps, case.global_batch, case.seq_len), generator=g)
    pad = getattr(text, "pad_token_id", None)
    if isinstance(pad, int) and 0 <= pad < vocab and vocab > 1:
        ids = torch.where(ids == pad, (pad + 1) % vocab, ids)
    return ids


def micro_batch(case: ParityCase, batch: torch.Tensor, k: int, dp_rank: int) -> torch.Tensor:
    i = (k * case.dp + dp_rank) * case.micro_batch_size
    return batch[i : i + case.micro_batch_size]
