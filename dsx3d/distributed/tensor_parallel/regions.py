"""One TP region entry shared by every projection that reads the same input, and the projections themselves.

Megatron's `f` all-reduces the input gradient of a column-parallel linear. q, k and v (or gate and up) read
the same input, so their input gradients can be summed first and reduced once: Megatron fuses the weights
(QKV, gate/up) to get there; dsx3d keeps Hugging Face's separate modules and shares the entry instead.

- `_Enter` (the entry, one per distinct input tensor within a pipeline item): forward identity, or with
  sequence parallelism the all-gather of the sequence shards; backward returns the reduced input gradient.
- `_RegionLinear` (each projection on the entry's output): y = x W^T + b. Its backward hands its partial
  input gradient dx_i = dy_i W_i (this rank's output columns only) to the entry instead of returning it,
  and computes its own weight gradient. The consumer whose backward runs last launches the collective on
  the sum (all-reduce; with sequence parallelism reduce-scatter) asynchronously *before* computing its
  weight gradient dW = dy^T x, so the two overlap (Megatron's and DeepSpeed's `tp_overlap_comm`); the
  entry's backward waits for it.

Gradients that reach the entry's output through autograd (a consumer that is not a `_RegionLinear`, e.g.
code that reads the full activation) are already complete (replicated) and are added after the reduction.
Weight gradients come back through autograd from the projection's own node, so ZeRO-2/3 gradient hooks see
them as usual.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsx3d.distributed.tensor_parallel.mappings import (
    ProcessGroup,
    _rows_back,
    gather_rows,
    own_rows,
    reduce_scatter_rows,
)
from dsx3d.distributed.tensor_parallel.weight_grad import WEIGHT_GRADS


class RegionEntry:
    """Backward state of one region entry: the partial input gradients of its consumers and the collective
    in flight. `gather`: the input is a sequence shard (sequence parallelism)."""

    def __init__(self, group: ProcessGroup, gather: bool, overlap: bool):
        self.group, self.gather, self.overlap = group, gather, overlap
        self.consumers = 0
        """`_RegionLinear`s built on this entry in the forward."""
        self._done = 0
        self._partial: torch.Tensor | None = None
        self._launched: tuple[torch.Tensor, Any] | None = None

    def contribute(self, grad: torch.Tensor) -> None:
        """A consumer's partial input gradient; the last consumer launches the reduction."""
        if self._launched is not None:
            raise RuntimeError("a TP region consumer ran backward after its entry's gradient was reduced")
        if self._partial is None:
            self._partial = grad
        else:
            self._partial.add_(grad)
        self._done += 1
        if self._done == self.consumers:
            self._launch()

    def _launch(self) -> None:
        assert self._partial is not None
        if self.gather:
            buf, work = reduce_scatter_rows(self._partial, self.group, async_op=True)
        else:
            buf = self._partial.contiguous()
            work = dist.all_reduce(buf, group=self.group, async_op=True)
        self._partial = None
        if not self.overlap:
            work.wait()
        self._launched = (buf, work)

    def finish(self) -> torch.Tensor | None:
        """The reduced gradient of the entry's input (this rank's shard with sequence parallelism), or None
        when no consumer contributed. Launches the collective if some consumer never ran backward."""
        if self._launched is None:
            if self._partial is None:
                return None
            self._launch()
        assert self._launched is not None
        buf, work = self._launched
        self._launched, self._done = None, 0
        work.wait()
        return _rows_back(buf) if self.gather else buf


class _Enter(torch.autograd.Function):
    """f: x -> x (replicated input) or the all-gathered sequence (b, s/t, h) -> (b, s, h); backward: the sum
    of the consumers' partial gradients, all-reduced or reduce-scattered (see RegionEntry)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, entry: RegionEntry) -> torch.Tensor:
        ctx.entry = entry
        ctx.set_materialize_grads(False)
        if entry.gather:
            return gather_rows(x, entry.group).contiguous()
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        entry: RegionEntry = ctx.entry
        reduced = entry.finish()
        if grad is not None:  # complete gradients from non-projection consumers: add this rank's part
            part = own_rows(grad, entry.group) if entry.gather else grad
            reduced = part if reduced is None else reduced + part
        return reduced, None


class _RegionLinear(torch.autograd.Function):
    """y = (x * mask) W^T + b on an entry's output x: (..., in) @ (in, out/t) -> (..., out/t). `mask` (a
    scaled dropout mask, LoRA's down projection) is None for the projections themselves."""

    @staticmethod
    def forward(ctx, x, weight, bias, entry: RegionEntry, mask=None):
        ctx.entry = entry
        ctx.has_bias = bias is not None
        ctx.params = (weight, bias)
        xm = x if mask is None else x * mask
        ctx.save_for_backward(xm, weight, mask)
        entry.consumers += 1
        return F.linear(xm, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        xm, weight, mask = ctx.saved_tensors
        dx = grad.matmul(weight)  # (..., out/t) @ (out/t, in): partial over TP
        ctx.entry.contribute(dx if mask is None else dx * mask)
        g2 = grad.reshape(-1, grad.shape[-1])
        if WEIGHT_GRADS.key is not None:  # a zero-bubble B pass: queue dW and db for its W pass if they can wait
            want_w = ctx.params[0] if ctx.needs_input_grad[1] else None
            want_b = ctx.params[1] if ctx.has_bias and ctx.needs_input_grad[2] else None
            if WEIGHT_GRADS.defer(want_w, want_b, g2, xm.reshape(-1, xm.shape[-1])):
                return None, None, None, None, None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # frozen base weights (LoRA) need none
            grad_weight = g2.t().matmul(xm.reshape(-1, xm.shape[-1]))  # (out/t, n) @ (n, in), overlaps the collective
        grad_bias = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return None, grad_weight, grad_bias, None, None


def enter(x: torch.Tensor, entry: RegionEntry) -> torch.Tensor:
    return _Enter.apply(x, entry)


def region_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    entry: RegionEntry,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    return _RegionLinear.apply(x, weight, bias, entry, mask)
