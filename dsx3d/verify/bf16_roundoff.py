"""What bf16 itself does to the quantities `dsx3d verify` compares, measured on the reference.

A bf16 run computes every matmul, norm and activation from operands rounded to bf16 (unit round-off
u = 2^-8), against an fp32 reference. How far that moves a loss, a gradient norm or one tensor's gradient
is not a fixed fraction: it is u times the condition of the computation, and the condition varies by orders
of magnitude between tensors (the final norm's gradient is a sum over the batch of terms that cancel, and a
tied head's softmax gradient sums ~vocabulary terms of 1/vocabulary each). A fixed rtol is either too loose
for the well-conditioned tensors (a fault hides in it) or too tight for the ill-conditioned ones (a correct
layout fails).

So the reference measures it: at each step it runs the same model once more in bf16 exactly as the 3D side
does (parameters cast to bf16 from the current fp32 weights, buffers such as rotary frequency tables left
in fp32 as DeepSpeed's engine leaves them, bf16 forward and backward, each micro-batch's gradient
accumulated in fp32, the global norm and clipping in fp32). The distance of that shadow from the
fp32 reference is the round-off of one bf16 evaluation of this model on this data, per quantity; the 3D
side rounds in a different order (TP shards, stage boundaries, reduction order), so its distance is
another draw of the same size. Under TP the shadow also rounds each partial sum a TP reduction adds, as the
parallel run does (`dsx3d.verify.tp_rounding`): without it, a tp-way run rounds more often than its shadow.
verify allows `BF16_DRAWS` times the shadow's distance on top of fp32's criterion, and, for stored weights,
each element's own rounding to bf16 (u |w|): the 3D side hands back its bf16 parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsx3d.models.buffer_dtypes import cast_buffers_as_hf
from dsx3d.verify.tp_rounding import round_as_tp

BF16_U = 2.0**-8
"""bf16's unit round-off: 8 significant bits, a value is rounded to within 2^-8 of itself (relative)."""
BF16_DRAWS = 4.0
"""A correct bf16 layout may differ from the fp32 reference by up to this many times the shadow's own bf16
round-off: both are sums of the same roundings in different orders, so their sizes spread by a small factor
around each other (more for a single scalar, such as one step's loss, than for a tensor's norm)."""


@dataclass
class Bf16Roundoff:
    """Per step: the shadow's distance from the fp32 reference."""

    loss: list[float] = field(default_factory=list)
    norm: list[float] = field(default_factory=list)
    """The gradient norm's round-off, tensor by tensor without cancellation (`norm_roundoff`)."""
    update: list[dict[str, float]] = field(default_factory=list)
    """SGD: ||dW_bf16 - dW_ref|| per tensor, dW = -lr x the clipped gradient (the clip coefficient is the
    shadow's own)."""
    grad: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Elementwise |g_bf16 - g_ref| of the unclipped gradients (for Adam's amplification)."""


def bf16_like_deepspeed(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` cast as dsx3d's engine casts a bf16 model: parameters to bf16 (DeepSpeed's cast),
    buffers to the dtype HF gives them in a bf16 model (`dsx3d.models.buffer_dtypes`: a rotary `inv_freq` stays
    fp32, a buffer HF computes in the default dtype becomes bf16)."""
    shadow = copy.deepcopy(model)
    for p in shadow.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    config = getattr(model, "config", None)
    if config is not None:
        cast_buffers_as_hf(shadow, config, torch.bfloat16)
    return shadow


def bf16_shadow(
    model: torch.nn.Module,
    accumulate: Callable[[torch.nn.Module], float],
    tp: int = 1,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and fp32 gradients (unclipped) of `model`'s current weights run in bf16; `accumulate(m)` runs the
    step's micro-batches through `m` and returns the mean loss (each micro-batch's backward into .grad). With
    `tp` > 1 the TP-sharded linears round their partial sums as a tp-way run does (`dsx3d.verify.tp_rounding`)."""
    shadow = bf16_like_deepspeed(model)
    config = getattr(model, "config", None)
    if config is not None:
        round_as_tp(shadow, config, tp)
    named = [(n, p) for n, p in shadow.named_parameters() if p.requires_grad]
    for _, p in named:
        p.grad = None
    sums = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in named}

    def accumulate_fp32() -> float:
        return accumulate(_Fp32Accumulating(shadow, named, sums))

    loss = accumulate_fp32()
    for n, p in named:
        if p.grad is not None:
            sums[n] += p.grad.float()
    return loss, sums


class _Fp32Accumulating(torch.nn.Module):
    """Calls the bf16 model; after each call's backward has filled .grad, the next call first moves .grad
    into the fp32 sums (DeepSpeed's fp32 gradient accumulation for bf16)."""

    def __init__(self, model: torch.nn.Module, named: list, sums: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.inner, self.named, self.sums = model, named, sums

    def forward(self, *args: object, **kwargs: object) -> object:
        for n, p in self.named:
            if p.grad is not None:
                self.sums[n] += p.grad.float()
                p.grad = None
        return self.inner(*args, **kwargs)


def record_step(
    out: Bf16Roundoff,
    ref_loss: float,
    ref_norm: float,
    ref_grads: dict[str, torch.Tensor],
    shadow_loss: float,
    shadow_grads: dict[str, torch.Tensor],
    lr: float,
    max_norm: float,
) -> None:
    """Record one step's distances; `ref_grads` are the reference's unclipped fp32 gradients."""
    with torch.no_grad():
        norm = sum(float(g.double().pow(2).sum()) for g in shadow_grads.values()) ** 0.5
        clip_ref = min(1.0, max_norm / (ref_norm + 1e-6))
        clip_b = min(1.0, max_norm / (norm + 1e-6))
        out.loss.append(abs(shadow_loss - ref_loss))
        out.norm.append(norm_roundoff(ref_grads, shadow_grads))
        out.update.append(
            {n: lr * float((clip_b * shadow_grads[n].double() - clip_ref * g.double()).norm()) for n, g in ref_grads.items()}
        )
        out.grad.append({n: (shadow_grads[n] - g).abs() for n, g in ref_grads.items()})


def norm_roundoff(ref_grads: dict[str, torch.Tensor], shadow_grads: dict[str, torch.Tensor]) -> float:
    """How far bf16 round-off can move the global gradient norm N: sum over tensors of |N_b,T^2 - N_ref,T^2|,
    divided by N_b + N_ref. Without the absolute value this is exactly the shadow's |N_b - N_ref|; but each
    tensor's share is its own draw (the 3D side rounds a TP-sharded tensor in another order than a replicated
    one, and each differently from the shadow), and the shadow's shares of either sign can cancel to almost
    nothing by chance where another draw's do not."""
    with torch.no_grad():
        shares, ref_sq, b_sq = 0.0, 0.0, 0.0
        for n, g in ref_grads.items():
            r, b = float(g.double().pow(2).sum()), float(shadow_grads[n].double().pow(2).sum())
            shares += abs(b - r)
            ref_sq, b_sq = ref_sq + r, b_sq + b
        total = ref_sq**0.5 + b_sq**0.5
        return shares / total if total > 0 else 0.0

