"""The LM head and its loss a tile of tokens at a time (`train.loss_tile_tokens`).

The last stage's logits are (tokens, V/tp) per rank; at long sequences and large vocabularies they, their
float32 softmax and their gradient dominate its memory. `tiled_head_loss` runs the head and the vocab-parallel
cross-entropy on `tile` rows of the hidden states at a time and keeps none of it: the forward sums the tiles'
per-token losses, the backward recomputes each tile's logits and differentiates them at once, adding up the
tiles' gradients of the hidden states and of the head's parameters. At most one tile's logits (and their
gradient) exist at a time.

The head's parameter gradients come back through autograd, once per micro-batch, from an identity node on the
hidden states (`anchor`) that the head item returns: DeepSpeed hooks the item's output tensors to run its
backward prologue (ZeRO's and the bf16 optimizer's bookkeeping, which clears the low-precision gradients) before
any gradient reaches a parameter, and the anchor's gradient arrives before the parameters' as the logits' would.
The gradient of the hidden states is this rank's part (its vocabulary columns): the caller enters the TP region
between the anchor and the loss (`copy_to_tp`, or `gather_from_sequence` under sequence parallelism), whose
backward sums it over TP.

DeepSpeed's `TiledFusedLogitsLoss` (runtime/sequence_parallel/ulysses_sp.py) runs the backward inside the
forward and writes `.grad` itself, with a fixed incoming gradient: a pipeline engine's loss scaling and a
zero-bubble schedule's deferred passes would not reach it, hence this function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TileLoss = Callable[[torch.Tensor, slice], torch.Tensor]
"""(hidden rows (n, h), their row slice) -> per-token losses (n,) in float32, built from the head's parameters."""


class ParamGrads:
    """The head's parameter gradients of one micro-batch, from the loss's backward to the anchor's."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.grads: list[torch.Tensor | None] | None = None


class _Anchor(torch.autograd.Function):
    """hidden -> hidden; backward: the hidden states' gradient, and the parameters' from `ParamGrads`."""

    @staticmethod
    def forward(ctx, holder: ParamGrads, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.holder = holder
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        holder: ParamGrads = ctx.holder
        grads = holder.grads if holder.grads is not None else [None] * len(holder.params)
        holder.grads = None
        return (None, grad, *grads)


def anchor(hidden: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, ParamGrads]:
    """The head item's output tensor, through which `tiled_head_loss` hands back the gradients of `params`."""
    holder = ParamGrads(params)
    return _Anchor.apply(holder, hidden, *params), holder


class _TiledHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: TileLoss, tile: int, holder: ParamGrads, hidden: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.tile, ctx.holder = run, tile, holder
        ctx.save_for_backward(hidden)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in _tiles(hidden.shape[0], tile):
            total += run(hidden[rows], rows).sum()
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (hidden,) = ctx.saved_tensors
        holder: ParamGrads = ctx.holder
        params = holder.params
        need_h = ctx.needs_input_grad[3]
        wanted = [i for i, p in enumerate(params) if p.requires_grad]
        grad_h = torch.zeros_like(hidden) if need_h else None
        sums = {i: torch.zeros_like(params[i], dtype=torch.float32) for i in wanted}
        for rows in _tiles(hidden.shape[0], ctx.tile):
            with torch.enable_grad():
                h = hidden[rows].detach().requires_grad_(need_h)
                loss = ctx.run(h, rows).sum()
                inputs = ([h] if need_h else []) + [params[i] for i in wanted]
                if not inputs:
                    break
                grads = torch.autograd.grad(loss, inputs, grad_outputs=grad, allow_unused=True)
            if need_h:
                assert grad_h is not None
                if grads[0] is not None:
                    grad_h[rows] = grads[0]
                grads = grads[1:]
            for i, g in zip(wanted, grads, strict=True):
                if g is not None:
                    sums[i] += g
        holder.grads = [sums[i].to(params[i].dtype) if i in sums else None for i in range(len(params))]
        return None, None, None, grad_h


def _tiles(n: int, tile: int) -> list[slice]:
    return [slice(a, min(a + tile, n)) for a in range(0, n, tile)]


def tiled_head_loss(run: TileLoss, tile: int, hidden: torch.Tensor, holder: ParamGrads) -> torch.Tensor:
    """Sum over the rows of `hidden` (tokens, h) of `run`'s per-token losses, `tile` rows at a time, with the
    tiles' logits recomputed in the backward (float32 scalar). `holder` (from `anchor`): every parameter `run`
    reads that may want a gradient (the head's weight and bias; frozen ones get none); `hidden` must descend
    from the anchor's output."""
    if tile <= 0:
        raise ValueError(f"tile must be positive, got {tile}")
    return _TiledHeadLoss.apply(run, tile, holder, hidden)
