"""peft LoRA on dsx3d's column- and row-parallel linears (2 forked gloo ranks), with LoRA dropout, against
the unsharded formula y = x W^T + b + s B A (x * mask) with the same mask: outputs, the input gradient
(column: through the shared region entry's reduction), A's and B's gradients (the whole one summed over TP,
the sharded one this rank's slice)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsx3d.distributed import comm
from dsx3d.verify.harness import run_ranks

pytestmark = pytest.mark.usefixtures("warm")

R, SCALE, P = 2, 2.0, 0.3


def _worker(rank: int, kind: str, state: dict[str, torch.Tensor], x: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    from peft import LoraConfig

    from dsx3d.distributed.comm import new_group
    from dsx3d.distributed.tensor_parallel.context import TPContext
    from dsx3d.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from dsx3d.models.lora import LoraSpec, freeze, inject
    from dsx3d.models.weights import StateDictSource

    world = comm.get_world_size()
    tp = TPContext(rank=rank, size=world, group=new_group(list(range(world))))
    linear = nn.Linear(state["w"].shape[1], state["w"].shape[0])
    holder = nn.Module()
    dim = 0 if kind == "column" else 1
    holder.proj = ColumnParallelLinear(linear, tp, gather_output=True) if kind == "column" else RowParallelLinear(linear, tp, split_input=True)
    holder.proj.weight.data.copy_(state["w"].chunk(world, dim=dim)[rank])
    holder.proj.bias.data.copy_(state["b"].chunk(world)[rank] if kind == "column" else state["b"])
    freeze(holder)
    spec = LoraSpec(LoraConfig(r=R, lora_alpha=R * SCALE, lora_dropout=P, target_modules=["proj"]))
    source = StateDictSource({"m.proj.lora_A.default.weight": state["a"], "m.proj.lora_B.default.weight": state["bb"]})
    inject(holder, "m.", spec, tp, source)
    inp = x.clone().requires_grad_()
    torch.manual_seed(7)
    y = holder.proj(inp)
    y.backward(dy)
    lora: Any = holder.proj
    return {
        "y": y.detach(),
        "dx": inp.grad,
        "da": lora.lora_A["default"].weight.grad,
        "db": lora.lora_B["default"].weight.grad,
    }


@pytest.mark.parametrize("kind", ["column", "row"])
def test_tp_lora_layer_equals_the_unsharded_formula(kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    out_f, in_f, world = 8, 6, 2
    state = {
        "w": torch.randn(out_f, in_f, generator=g),
        "b": torch.randn(out_f, generator=g),
        "a": torch.randn(R, in_f, generator=g),
        "bb": torch.randn(out_f, R, generator=g),
    }
    x, dy = torch.randn(3, 4, in_f, generator=g), torch.randn(3, 4, out_f, generator=g)
    # the mask each rank draws after manual_seed(7): the whole input's (column), or the shard's on every rank (row)
    torch.manual_seed(7)
    if kind == "column":
        mask = nn.Dropout(P)(torch.ones_like(x))
    else:
        mask = torch.cat([nn.Dropout(P)(torch.ones(3, 4, in_f // world))] * world, dim=-1)
    ref_x, a, b = x.clone().requires_grad_(), state["a"].clone().requires_grad_(), state["bb"].clone().requires_grad_()
    ref = F.linear(ref_x, state["w"], state["b"]) + SCALE * F.linear(F.linear(ref_x * mask, a), b)
    ref.backward(dy)
    results = run_ranks(_worker, world, kind, state, x, dy)
    for r in results:
        torch.testing.assert_close(r["y"], ref.detach())
        torch.testing.assert_close(r["dx"], ref_x.grad)
    whole, sharded, dim = ("da", "db", 0) if kind == "column" else ("db", "da", 1)
    ref_grads = {"da": a.grad, "db": b.grad}
    for r in results:
        torch.testing.assert_close(r[whole], ref_grads[whole])  # summed over TP
    torch.testing.assert_close(torch.cat([r[sharded] for r in results], dim=dim), ref_grads[sharded])
