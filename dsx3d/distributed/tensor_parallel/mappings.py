"""Tensor-parallel autograd functions on plain tensors, each taking its process group explicitly.

In the notation of Megatron-LM (Shoeybi et al. 2019): `f` is identity forward / all-reduce backward (enters a
TP region), `g` is all-reduce forward / identity backward (leaves it). A column-parallel linear is f then a
local matmul; a row-parallel linear is a local matmul then g. With one rank in the group all are identities.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
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
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, size = dist.get_rank(ctx.group), group_size(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


class _SplitLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim (b, s, n) -> (b, s, n/t); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, size = dist.get_rank(group), group_size(group)
        return x.chunk(size, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(group_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherLastDim.apply(x, group)


def split_last_dim(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _SplitLastDim.apply(x, group)


def all_reduce_grad_hook(group: ProcessGroup | None):
    """A tensor hook that sums a replicated parameter's partial gradient over the TP group
    (`replicated_with_grad_allreduce`: q/k norms see only this rank's heads)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if group_size(group) == 1:
            return grad
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook
