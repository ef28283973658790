"""Each tensor-parallel primitive on its own, against plain single-process torch (Megatron tests its mappings
and cross-entropy the same way): forward values and gradients on 2 and 3 forked gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsx3d.distributed import comm
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from dsx3d.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dsx3d.distributed.tensor_parallel.mappings import (
    copy_to_tp,
    gather_last_dim,
    reduce_from_tp,
    split_last_dim,
)
from dsx3d.pipeline.split import balanced_bounds, bounds_from_stage_layers
from dsx3d.verify.harness import run_ranks

pytestmark = pytest.mark.usefixtures("warm")


def _world_group():
    from dsx3d.distributed.comm import new_group

    return new_group(list(range(comm.get_world_size())))


def _mappings_worker(rank: int, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    group = _world_group()
    world = comm.get_world_size()
    out: dict[str, torch.Tensor] = {}
    # f: identity forward, all-reduce backward
    a = x.clone().requires_grad_()
    copy_to_tp(a, group).backward(grad * (rank + 1))
    out["f_grad"] = a.grad
    # g: all-reduce forward, identity backward
    b = (x * (rank + 1)).requires_grad_()
    y = reduce_from_tp(b, group)
    y.backward(grad)
    out["g_out"], out["g_grad"] = y.detach(), b.grad
    # gather: concatenate the last dim; backward keeps this rank's slice
    c = x.chunk(world, dim=-1)[rank].clone().requires_grad_()
    z = gather_last_dim(c, group)
    z.backward(grad)
    out["gather_out"], out["gather_grad"] = z.detach(), c.grad
    # split: keep this rank's slice; backward all-gathers
    d = x.clone().requires_grad_()
    w = split_last_dim(d, group)
    w.backward(grad.chunk(world, dim=-1)[rank])
    out["split_out"], out["split_grad"] = w.detach(), d.grad
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_mappings_forward_and_backward(world: int) -> None:
    torch.manual_seed(0)
    x, grad = torch.randn(2, 5, 6 * world), torch.randn(2, 5, 6 * world)
    results = run_ranks(_mappings_worker, world, x, grad)
    total = sum(r + 1 for r in range(world))
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["f_grad"], grad * total)  # partial gradients summed
        torch.testing.assert_close(r["g_out"], x * total)  # partial sums summed
        torch.testing.assert_close(r["g_grad"], grad)
        torch.testing.assert_close(r["gather_out"], x)
        torch.testing.assert_close(r["gather_grad"], grad.chunk(world, dim=-1)[rank])
        torch.testing.assert_close(r["split_out"], x.chunk(world, dim=-1)[rank])
        torch.testing.assert_close(r["split_grad"], grad)


def _cross_entropy_worker(rank: int, logits: torch.Tensor, target: torch.Tensor, valid: int) -> dict[str, torch.Tensor]:
    group = _world_group()
    world = comm.get_world_size()
    part = logits.shape[-1] // world
    local = logits[:, rank * part : (rank + 1) * part].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, rank * part, valid, group)
    loss.sum().backward()
    return {"loss": loss.detach(), "grad": local.grad}


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_cross_entropy_equals_torch(world: int) -> None:
    """Per-token losses and logit gradients equal F.cross_entropy on the gathered logits, with ignored
    targets and padded vocabulary columns (a vocabulary tp does not divide) masked out."""
    torch.manual_seed(1)
    valid = 6 * world - 1  # one padding column on the last rank
    logits = torch.randn(10, 6 * world) * 3
    target = torch.randint(0, valid, (10,))
    target[[2, 7]] = IGNORE_INDEX
    results = run_ranks(_cross_entropy_worker, world, logits, target, valid)
    ref_logits = logits[:, :valid].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, ignore_index=IGNORE_INDEX, reduction="none")
    ref.sum().backward()
    assert ref_logits.grad is not None
    full_grad = torch.cat([r["grad"] for r in results], dim=-1)
    for r in results:
        torch.testing.assert_close(r["loss"], ref)
    torch.testing.assert_close(full_grad[:, :valid], ref_logits.grad)
    assert torch.count_nonzero(full_grad[:, valid:]) == 0  # padding columns get no gradient


def _linear_worker(rank: int, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    group = _world_group()
    world = comm.get_world_size()
    tp = TPContext(rank=rank, size=world, group=group)
    out: dict[str, torch.Tensor] = {}
    for kind in ("column", "row"):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
        layer = (
            ColumnParallelLinear(linear, tp, gather_output=True)
            if kind == "column"
            else RowParallelLinear(linear, tp, split_input=True)
        )
        dim = 0 if kind == "column" else 1
        layer.weight.data.copy_(weight.chunk(world, dim=dim)[rank])
        assert layer.bias is not None
        layer.bias.data.copy_(bias.chunk(world)[rank] if kind == "column" else bias)
        inp = x.clone().requires_grad_()
        y = layer(inp)
        y.sum().backward()
        out[f"{kind}_out"], out[f"{kind}_input_grad"] = y.detach(), inp.grad
        out[f"{kind}_weight_grad"] = layer.weight.grad
    return out


def test_column_and_row_parallel_linears_equal_nn_linear() -> None:
    torch.manual_seed(2)
    weight, bias, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 4, 6)
    ref_w = weight.clone().requires_grad_()
    ref_x = x.clone().requires_grad_()
    ref = F.linear(ref_x, ref_w, bias)
    ref.sum().backward()
    assert ref_w.grad is not None and ref_x.grad is not None
    # gather_output / split_input make both layers take and give full tensors, so each equals nn.Linear
    results = run_ranks(_linear_worker, 2, weight, bias, x)
    for kind, dim in (("column", 0), ("row", 1)):
        for r in results:
            torch.testing.assert_close(r[f"{kind}_out"], ref.detach())
            torch.testing.assert_close(r[f"{kind}_input_grad"], ref_x.grad)
        torch.testing.assert_close(torch.cat([r[f"{kind}_weight_grad"] for r in results], dim=dim), ref_w.grad)


def test_partition_bounds() -> None:
    # contiguous, non-empty, minimal max-stage cost
    assert balanced_bounds([1.0] * 8, 4) == [0, 2, 4, 6, 8]
    assert balanced_bounds([0.0, 1, 1, 1, 1, 0.0, 3.0], 2) == [0, 4, 7]
    with pytest.raises(ValueError):
        balanced_bounds([1.0, 1.0], 3)
    # prologue items on the first stage, epilogue and head on the last
    assert bounds_from_stage_layers([1, 3], num_extra_first=1, num_extra_last=2) == [0, 2, 7]
    import random

    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.choice([0.0, rng.random() * 10]) for _ in range(rng.randint(2, 12))]
        stages = rng.randint(1, len(costs))
        bounds = balanced_bounds(costs, stages)
        assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == stages + 1
        assert all(a < b for a, b in zip(bounds[:-1], bounds[1:]))
        best = max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
        assert best <= _brute_force_best(costs, stages) + 1e-9


def _brute_force_best(costs: list[float], stages: int) -> float:
    from itertools import combinations

    n = len(costs)
    return min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in combinations(range(1, n), stages - 1)
    )
