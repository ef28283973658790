"""Does the 3D side clip with the norm of the gradient it applies? A check of the SGD run that needs no
reference and so no allowance for bf16.

With plain SGD a step moves the weights by dW = -lr c g, c = min(1, max_norm / (N + 1e-6)), where g is the
gradient the engine applied and N the global norm it clipped with. So ||dW|| / lr = c ||g||, and if N is
the norm of g, that is c N: the norm the engine reports fixes the length of the whole update. Both sides
of the comparison come from the 3D run (its fp32 weights, or in bf16 its fp32 master weights), so bf16's
round-off of the gradient itself cancels; what is left is fp32's rounding of W - lr c g (one spacing per
element) and of the norm's sum. A norm that counts some gradients twice, or misses some, changes N but not
g: the update's length then disagrees with the reported norm by the share of the squared norm that was
miscounted, which in bf16 lies far below the round-off of the gradients (and so of the norm compared with
the reference's) but far above fp32's spacing.

The engine's fp32 sum of a tensor's squares adds them one after another (torch's CPU kernel in 8 vector lanes;
a GPU thread, a TP shard or a ZeRO partition likewise sums a subsequence of the tensor in its order). A square
below the spacing of the running sum is lost or rounded up to that spacing: its error is at most itself, and
always a loss where the tensor holds many squares far below the sum's spacing, which random rounding does not
average out. A large untied head is such a tensor: the rows of the tokens in the batch carry its norm, all the
others a gradient of softmax probabilities of about 1/V, so its fp32 norm comes out below the exact one by
more than fp32's spacing of the update. `swamped_squares` bounds those squares from the update itself.
"""

from __future__ import annotations

import torch

from dsx3d.recipe.ds_optimizer import BF16_OPTIMIZER, grad_accum_dtype, optimizer_wrapper
from dsx3d.verify.case import FP32_EPS, Check

# half the spacing of a low-precision number relative to its value: the most rounding to it changes a value
_HALF_ULP = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def clipped_gradient_rounding(dtype: str, zero_stage: int, *, pipeline: bool) -> float:
    """The relative rounding of the gradient the engine applies after clipping: 0 when it clips an fp32
    gradient; half a unit in the last place when DeepSpeed accumulates gradients in the model's dtype (bf16 or
    fp16 without ZeRO, as the generated config does) and multiplies them by the clip coefficient in place
    (`clip_tensors_by_global_norm` on BF16_Optimizer's bf16 gradient buffer), which rounds every element
    again. The update's length can then differ from the clipped norm by up to that fraction."""
    accum = grad_accum_dtype(dtype, zero_stage)
    if dtype == "fp32" or accum == "fp32":
        return 0.0
    try:
        wrapper = optimizer_wrapper(dtype, zero_stage, accum, pipeline=pipeline)
    except ValueError:
        return 0.0
    return _HALF_ULP.get(dtype, 0.0) if wrapper == BF16_OPTIMIZER else 0.0


def swamped_squares(step: torch.Tensor) -> float:
    """The sum of the squares of `step` (a tensor's update, -lr c g: the same shares as its gradient's) that an
    fp32 running sum of them in storage order may lose or round up: every square below the spacing of fp32
    numbers at the sum of the squares before it (FP32_EPS times that sum, which bounds the spacing of any
    subsequence's running sum too). Each such square moves the sum by at most itself; a larger one by at most
    half a spacing, with either sign (the sqrt(n) term of `applied_norm_check`)."""
    squares = step.double().flatten().pow(2)
    before = torch.cumsum(squares, 0) - squares
    return float(squares[squares < FP32_EPS * before].sum())


def applied_norm_check(
    before: list[dict[str, torch.Tensor]],
    after: list[dict[str, torch.Tensor]],
    norms: list[float],
    lr: float,
    max_norm: float,
    params: set[str],
    rtol: float = 1e-5,
    rounding: float = 0.0,
) -> Check:
    """Every step: | ||W_t+1 - W_t|| / lr - c N | <= rtol max(1, c N) + the weights' fp32 spacing / lr + the
    engine's fp32 sum of squares (its random rounding, and the squares it may lose: `swamped_squares`), plus
    `rounding` c N when the engine clips a gradient held in low precision (`clipped_gradient_rounding`) and
    so rounds every element of the clipped gradient again (|e_i| <= rounding |c g_i|, so the length moves by at
    most rounding c N)."""
    worst, where, ok = 0.0, "", True
    for t, norm in enumerate(norms):
        moved, spacing, summation, swamped = 0.0, 0.0, 0.0, 0.0
        for name in params:
            w0, w1 = before[t][name].double(), after[t][name].double()
            square = float((w1 - w0).pow(2).sum())
            moved += square
            summation += square * w0.numel() ** 0.5
            swamped += swamped_squares(w1 - w0)
            spacing += float((FP32_EPS * torch.maximum(w0.abs(), w1.abs())).pow(2).sum())
        applied = moved**0.5 / lr
        expected = min(1.0, max_norm / (norm + 1e-6)) * norm
        # the engine's own norm sums a tensor's squares in fp32 (bf16 ZeRO and BF16_Optimizer): rounding off by
        # about sqrt(n) u of that tensor's share, and short by at most the swamped squares (half their share of
        # the squared norm)
        summed = (FP32_EPS / 2 * summation + swamped / 2) / moved if moved > 0 else 0.0
        clipped = expected < norm  # the clip coefficient multiplied the gradient (and rounded it, in low precision)
        allowed = (rtol + summed) * max(1.0, expected) + spacing**0.5 / lr + (rounding * expected if clipped else 0.0)
        ratio = abs(applied - expected) / allowed
        ok = ok and ratio <= 1.0  # NaN never passes
        if not ratio <= worst:
            worst = ratio
            where = f"step {t + 1}: update length / lr {applied:.7g}, clipped norm {expected:.7g} (norm {norm:.7g})"
    return Check("applied_norm", worst, where, ok)
