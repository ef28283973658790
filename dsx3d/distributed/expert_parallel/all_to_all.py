"""The all-to-all token exchange of expert parallelism, differentiable, on an explicit process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


class _AllToAll(torch.autograd.Function):
    """Rows of x (n, h) go to the ranks of `group` in order: the first send_sizes[0] rows to group rank 0, the
    next send_sizes[1] to rank 1, ...; the result stacks recv_sizes[i] rows from each rank i. The backward pass
    is the same exchange with the sizes swapped (the gradient of a row goes back to the rank that sent it)."""

    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        return _exchange(x, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes = ctx.sizes
        return _exchange(grad, recv_sizes, send_sizes, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
    return out


def all_to_all(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    return _AllToAll.apply(x, send_sizes, recv_sizes, group)


def exchange_counts(counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """counts (g, n) int64, row i for group rank i -> (g, n): row i is what rank i has for this rank."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)
