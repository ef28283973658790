"""Tensor-parallel autograd functions on plain tensors, each taking its process group explicitly.

In the notation of Megatron-LM (Shoeybi et al. 2019): `f` is identity forward / all-reduce backward (enters a
TP region), `g` is all-reduce forward / identity backward (leaves it). A column-parallel linear is f then a
local matmul; a row-parallel linear is a local matmul then g. With one rank in the group all are identities.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    """f: forward identity, backward all-reduce (each rank holds a partial gradient of the shared input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce of partial sums, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather shards along the last dim (b, s, n/t) -> (b, s, n); backward keeps the own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, size = dist.get_rank(ctx.group), _size(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


class _SplitLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim (b, s, n) -> (b, s, n/t); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, size = dist.get_rank(group), _size(group)
        return x.chunk(size, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherLastDim.apply(x, group)


def split_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if _size(group) == 1 else _SplitLastDim.apply(x, group)


def all_reduce_grad_hook(group: ProcessGroup | None):
    """A tensor hook that sums a replicated parameter's partial gradient over the TP group
    (`replicated_with_grad_allreduce`: q/k norms see only this rank's heads)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if _size(group) == 1:
            return grad
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits without gathering them.

    logits: (n, v_local) this rank's columns [start, start + v_local); target: (n,) global ids, -100 ignored;
    columns >= valid_vocab (padding) are excluded. Returns per-token losses (n,), 0 where ignored.
    loss_i = log(sum_j exp(z_ij - m_i)) - (z_i,t - m_i), with m_i, the sum and z_i,t all-reduced over TP.
    """

    @staticmethod
    def forward(ctx, logits, target, start, valid_vocab, group):
        z = logits.float()
        v_local = z.shape[-1]
        cols = torch.arange(start, start + v_local, device=z.device)
        pad = cols >= valid_vocab
        if bool(pad.any()):
            z = z.masked_fill(pad, float("-inf"))
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m.unsqueeze(-1)
        ez = z.exp()
        sum_ez = ez.sum(dim=-1)
        dist.all_reduce(sum_ez, group=group)
        ignored = target == -100
        local = target - start
        mine = (local >= 0) & (local < v_local) & ~ignored
        local = torch.where(mine, local, torch.zeros_like(local))
        z_t = torch.where(mine, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
        dist.all_reduce(z_t, group=group)
        loss = torch.where(ignored, torch.zeros_like(m), sum_ez.log() - z_t)
        softmax = ez / sum_ez.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, ignored = ctx.saved_tensors
        # d loss_i / d z_ij = softmax_ij - [j == t_i]
        grad = softmax.clone()
        rows = torch.nonzero(mine, as_tuple=True)[0]
        grad[rows, local[rows]] -= 1.0
        grad = grad * (grad_loss * (~ignored)).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, start: int, valid_vocab: int, group: ProcessGroup | None
) -> torch.Tensor:
    """Per-token loss for (n, v_local) logits; works for a single rank too (group None or size 1)."""
    if _size(group) == 1:
        z = logits.float()
        if z.shape[-1] > valid_vocab:
            z = z[..., :valid_vocab]
        return torch.nn.functional.cross_entropy(z, target, ignore_index=-100, reduction="none")
    return _VocabParallelCE.apply(logits, target, start, valid_vocab, group)
