"""Global-norm gradient clipping for the single-process reference of `dsx3d verify`, with the norm exact.

torch's `clip_grad_norm_` reduces each tensor in fp32, whose error grows with the element count: on a large
vocabulary the embedding gradient's norm can come out further from the exact one than fp32 verify's norm
tolerance, while DeepSpeed and dsx3d.distributed.grad_clip sum the squares in float64. A reference must not
carry an error of its own that grows with the model, so it sums in float64 too.
"""

from __future__ import annotations

import torch


def exact_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """sqrt(sum of every gradient element squared), summed in float64: exact to fp32's round-off whatever the
    tensors' sizes. A tied weight is one parameter, counted once."""
    with torch.no_grad():
        return sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None) ** 0.5


def clip_by_exact_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """torch's clip_grad_norm_ (scale by min(1, max_norm / (norm + 1e-6))) with `exact_grad_norm`."""
    norm = exact_grad_norm(params)
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm
