"""Deferred weight gradients: the W passes of a zero-bubble pipeline schedule.

A linear's backward has two independent parts: the input gradient dx = dy W, which the previous pipeline stage
waits for, and the weight gradient dW = dy^T x (db = sum dy), which nobody waits for. While a stage runs a B
pass (`WEIGHT_GRADS.collect(micro_batch)`), the linears dsx3d computes itself (the TP projections of
`regions._RegionLinear`; the row-parallel linears and, at tp = 1, the decoder layers' `nn.Linear`s and the
LM head once `defer_linears` switched them) return only dx and queue (W, b, dy, x); its W pass (`WEIGHT_GRADS.run(micro_batch)`) computes
the queued products and adds them to `.grad`. Outside B passes (1F1B, evaluation) nothing is queued.

Only leaf parameters without gradient hooks are deferred (a hook, e.g. a LoRA adapter summed over TP, must see
its gradient inside the backward); everything else (norms, embeddings, biases added outside a linear, experts)
gets its gradient in B as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class _Job:
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    grad: torch.Tensor  # (n, out) output gradient rows
    inp: torch.Tensor  # (n, in) input rows


DEFER_OK = "_dsx3d_post_hooks_may_wait"
"""Set on a parameter whose post-accumulate hooks are known not to need the gradient (DeepSpeed ZeRO-1's
bookkeeping hooks when it accumulates in `.grad`; `dsx3d.pipeline.zb_schedule.install_zero_bubble` decides)."""


def deferrable(t: torch.Tensor | None) -> bool:
    """A parameter whose gradient may be added to `.grad` later: a leaf that wants a gradient, without hooks
    that must see it during the backward."""
    if t is None or not t.requires_grad or not t.is_leaf or getattr(t, "_backward_hooks", None):
        return False
    return not getattr(t, "_post_accumulate_grad_hooks", None) or getattr(t, DEFER_OK, False)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


@dataclass
class WeightGradQueue:
    """The weight-gradient products of this process's B passes, by micro-batch, until their W pass."""

    key: int | None = None
    """The micro-batch whose B pass is running (None: compute weight gradients at once)."""
    pending: dict[int, list[_Job]] = field(default_factory=dict)

    @contextlib.contextmanager
    def collect(self, key: int) -> Iterator[None]:
        if self.key is not None:
            raise RuntimeError(f"B pass of micro-batch {key} started inside the B pass of {self.key}")
        self.key = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def defer(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, grad: torch.Tensor, inp: torch.Tensor
    ) -> bool:
        """Queue dW = grad^T inp (and db = sum grad) for the running B pass; False (nothing queued) outside one
        or when a parameter cannot wait. `grad` (n, out) and `inp` (n, in) are row matrices."""
        if self.key is None or (weight is None and bias is None):
            return False
        if (weight is not None and not deferrable(weight)) or (bias is not None and not deferrable(bias)):
            return False
        self.pending[self.key].append(_Job(weight, bias, grad, inp))
        return True

    @torch.no_grad()
    def run(self, key: int) -> int:
        """The W pass of micro-batch `key`: add its queued weight gradients to `.grad`; the number of jobs run."""
        jobs = self.pending.pop(key, [])
        for job in jobs:
            if job.weight is not None:
                _accumulate(job.weight, job.grad.t().matmul(job.inp))
            if job.bias is not None:
                _accumulate(job.bias, job.grad.sum(0))
        return len(jobs)

    def own_grads(self, key: int, shared: set[int]) -> int:
        """Give the queued products of micro-batch `key` a private copy of any output gradient stored in one
        of the `shared` storages (data pointers of a buffer the caller reuses); the number copied."""
        copied = 0
        for job in self.pending.get(key, []):
            if job.grad.untyped_storage().data_ptr() in shared:
                job.grad = job.grad.clone()
                copied += 1
        return copied

    def clear(self) -> None:
        self.pending.clear()
        self.key = None


WEIGHT_GRADS = WeightGradQueue()
"""One per process: a process runs one pipeline stage."""


class _DeferrableLinear(torch.autograd.Function):
    """y = x W^T + b whose backward queues dW and db while a B pass collects them (else computes them)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.params = (weight, bias)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        w_param, b_param = ctx.params
        dx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        want_w = w_param if ctx.needs_input_grad[1] else None
        want_b = b_param if b_param is not None and ctx.needs_input_grad[2] else None
        if WEIGHT_GRADS.defer(want_w, want_b, g2, x2):
            return dx, None, None
        dw = g2.t().matmul(x2) if want_w is not None else None
        db = g2.sum(0) if want_b is not None else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose weight gradients can be deferred (see the module docstring)."""
    return _DeferrableLinear.apply(x, weight, bias)


def defer_linears(module: nn.Module) -> int:
    """Rewire every plain `nn.Linear` inside `module` with a trainable weight to `linear`, and switch dsx3d's
    row-parallel linears and LM head (tp = 1) to it; the number rewired. (The column projections of `regions` defer on their own.)"""
    count = 0
    for sub in module.modules():
        if hasattr(sub, "defer_weight_grad"):  # a row-parallel linear or the LM head: their own switch
            sub.defer_weight_grad = True  # type: ignore[assignment]
            count += 1
        elif type(sub) is nn.Linear and sub.weight.requires_grad:
            sub.forward = _linear_forward(sub)  # type: ignore[method-assign]
            count += 1
    return count


def _linear_forward(sub: nn.Linear):  # type: ignore[no-untyped-def]
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, sub.weight, sub.bias)

    return forward
