"""verify's applied-norm check (dsx3d.verify.clip_check): the length of an SGD update equals lr times the
clipped norm the engine reports, to fp32's spacing; a norm that counts a small replicated tensor twice (a
share of 4e-5 of the squared norm, far below bf16's round-off of the gradient) fails it."""

from __future__ import annotations

import torch

from dsx3d.verify.clip_check import applied_norm_check

LR, MAX_NORM = 0.5, 1.0


def _step(norm_scale: float, grad_scale: float) -> tuple[dict, dict, float]:
    g = torch.Generator().manual_seed(0)
    w0 = {"w": torch.randn(256, 64, generator=g) * 0.02, "norm": torch.ones(64)}
    grads = {"w": torch.randn(256, 64, generator=g) * grad_scale, "norm": torch.randn(64, generator=g) * 1e-3 * grad_scale}
    true = sum(float(t.double().pow(2).sum()) for t in grads.values()) ** 0.5
    reported = (true**2 + (norm_scale - 1) * float(grads["norm"].double().pow(2).sum())) ** 0.5  # norm counted norm_scale times
    clip = min(1.0, MAX_NORM / (reported + 1e-6))
    w1 = {n: (w0[n].double() - LR * clip * grads[n].double()).float() for n in w0}
    return w0, w1, reported


def test_a_correct_step_passes_clipped_or_not() -> None:
    for grad_scale in (1.0, 1e-3):  # norm ~ 128: clipped; ~0.13: not clipped
        w0, w1, reported = _step(1.0, grad_scale)
        check = applied_norm_check([w0], [w1], [reported], LR, MAX_NORM, set(w0))
        assert check.ok and check.worst < 0.1, vars(check)


def test_a_norm_counting_a_replicated_tensor_twice_fails() -> None:
    g = torch.Generator().manual_seed(0)
    w0 = {"w": torch.randn(256, 64, generator=g) * 0.02, "norm": torch.ones(64)}
    grads = {"w": torch.randn(256, 64, generator=g) * 0.01, "norm": torch.randn(64, generator=g) * 0.01}
    true = sum(float(t.double().pow(2).sum()) for t in grads.values()) ** 0.5
    share = float(grads["norm"].double().pow(2).sum()) / true**2
    assert share < 1e-2
    reported = (true**2 + float(grads["norm"].double().pow(2).sum())) ** 0.5
    clip = min(1.0, MAX_NORM / (reported + 1e-6))
    w1 = {n: (w0[n].double() - LR * clip * grads[n].double()).float() for n in w0}
    check = applied_norm_check([w0], [w1], [reported], LR, MAX_NORM, set(w0))
    assert not check.ok, vars(check)


def test_a_clip_applied_to_a_bf16_gradient_buffer_is_allowed_its_rounding_only() -> None:
    """BF16_Optimizer accumulating in bf16 (bf16 without ZeRO in a pipeline) multiplies its bf16 gradients by
    the clip coefficient in place, rounding each element again: the update's length then differs from the
    clipped norm by up to half a bf16 ulp of it. That rounding is allowed there, and nowhere else."""
    from dsx3d.verify.clip_check import clipped_gradient_rounding

    g = torch.Generator().manual_seed(1)
    w0 = {"w": torch.randn(64, 32, generator=g) * 0.02}
    grad = torch.randn(64, 32, generator=g).bfloat16()
    norm = float(grad.double().pow(2).sum()) ** 0.5
    clip = MAX_NORM / (norm + 1e-6)
    applied = (grad * clip).double()  # rounded to bf16 by the in-place multiply, then widened
    w1 = {"w": (w0["w"].double() - LR * applied).float()}
    rounding = clipped_gradient_rounding("bf16", 0, pipeline=True)
    assert rounding == 2.0**-8
    assert not applied_norm_check([w0], [w1], [norm], LR, MAX_NORM, {"w"}).ok  # beyond fp32's criterion
    assert applied_norm_check([w0], [w1], [norm], LR, MAX_NORM, {"w"}, rounding=rounding).ok
    for dtype, stage, pipeline in (("bf16", 1, True), ("fp32", 0, True), ("bf16", 0, False), ("bf16", 2, False)):
        assert clipped_gradient_rounding(dtype, stage, pipeline=pipeline) == 0.0
