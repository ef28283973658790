"""Tensor-parallel autograd functions on plain tensors, each taking its process group explicitly.

In the notation of Megatron-LM (Shoeybi et al. 2019): `f` is identity forward / all-reduce backward (enters a
TP region), `g` is all-reduce forward / identity backward (leaves it). A column-parallel linear is f then a
local matmul; a row-parallel linear is a local matmul then g. With one rank in the group all are identities.

With sequence parallelism (Korthikanti et al. 2022) activations outside the TP regions are split along the
sequence: `f` becomes an all-gather along the sequence (backward: reduce-scatter) and `g` a reduce-scatter
(backward: all-gather). The sequence is dim -2 of every activation: (b, s, h) and flattened (tokens, h) alike;
token-wise code does not care which rows a rank holds, attention gets the whole sequence back in order.
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


# -- sequence parallelism: dim -2 split over the TP ranks ---------------------------------------------------


def _rows_first(x: torch.Tensor) -> torch.Tensor:
    """(..., n, h) -> (n, ..., h) contiguous: collectives split and join the leading dim."""
    return x.movedim(-2, 0).contiguous()


def _rows_back(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(0, -2)


def gather_rows(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """All-gather dim -2: (..., n/t, h) -> (..., n, h), rank order. With async_op, (buffer, work): the
    result is `_rows_back(buffer)` once `work.wait()` returned."""
    local = _rows_first(x)
    out = local.new_empty((local.shape[0] * group_size(group), *local.shape[1:]))
    work = dist.all_gather_single(out, local, group=group, async_op=async_op)
    return (out, work) if async_op else _rows_back(out)


def reduce_scatter_rows(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """Sum over the group and keep this rank's block of dim -2: (..., n, h) -> (..., n/t, h). With async_op,
    (buffer, work) as in `gather_rows`."""
    full = _rows_first(x)
    size = group_size(group)
    if full.shape[0] % size:
        raise RuntimeError(
            f"sequence parallelism: {full.shape[0]} rows (sequence positions or tokens) do not split over "
            f"{size} TP ranks; the sequence length must be a multiple of tp (or set parallel.sequence_parallel: false)"
        )
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    work = dist.reduce_scatter_single(out, full, group=group, async_op=async_op)
    return (out, work) if async_op else _rows_back(out)


def own_rows(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's block of dim -2 (no communication)."""
    size = group_size(group)
    if x.shape[-2] % size:
        raise RuntimeError(
            f"sequence parallelism: {x.shape[-2]} rows (sequence positions or tokens) do not split over "
            f"{size} TP ranks; the sequence length must be a multiple of tp (or set parallel.sequence_parallel: false)"
        )
    return x.chunk(size, dim=-2)[dist.get_rank(group)].contiguous()


class _ReduceScatterRows(torch.autograd.Function):
    """g with sequence parallelism: partial sums (..., n, h) -> summed block (..., n/t, h); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_rows(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.group), None


class _SplitRows(torch.autograd.Function):
    """A replicated (..., n, h) becomes this rank's block (..., n/t, h); backward all-gathers the blocks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.group), None


def reduce_scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterRows.apply(x, group)


def split_to_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _SplitRows.apply(x, group)


class _GatherRows(torch.autograd.Function):
    """A sequence shard (..., n/t, h) becomes the whole sequence (..., n, h) for per-rank computation whose
    gradient is partial over TP (a rank's vocabulary columns); backward sums it and keeps this rank's block."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_rows(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad, ctx.group).contiguous(), None


def gather_from_sequence(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherRows.apply(x, group)
