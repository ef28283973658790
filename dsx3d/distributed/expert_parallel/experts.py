"""A family's own experts module, split over the TP and EP ranks, still running the family's own forward.

Hugging Face MoE blocks call `experts(hidden_states (T, h), top_k_index (T, k), top_k_weights (T, k))` and get
sum_k w_tk * expert_{i_tk}(x_t) back; the experts keep their weights as (E, ...) tensors and skip the sentinel
expert id E (transformers' own expert parallelism sets `num_experts` to the local count and routes other
ranks' experts to it). `shard_experts` keeps a rank's n = E / (ep * tp) experts (`placement`) and replaces
the module's forward with a region:

- tokens are replicated over TP, so no exchange is needed there: each TP rank runs the routes to its own
  experts (the others become the sentinel) and the partial sums are added over TP like a row-parallel layer.
  The region is entered with `TPContext.enter_region` for the hidden states and the routing weights (their
  gradients are partial per TP rank: all-reduced backward, Megatron's f) and left with `exit_region` (g);
- with ep > 1 the routes of a TP rank's slot go to the EP rank holding their expert, all-to-all over the EP
  group (DeepSpeed-MoE, Megatron and torchtitan do the same); the experts run top-1 with unit weights on what
  they receive, results come back with a second all-to-all and are weighted and summed on the sender.

The router, shared experts and auxiliary losses are untouched: they run replicated, as in the family's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dsx3d.distributed.expert_parallel.all_to_all import all_to_all, exchange_counts
from dsx3d.distributed.expert_parallel.placement import ExpertPlacement
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.layers import mark_sharded


@dataclass
class ExpertContext:
    """A rank's coordinates for the experts: its TP context, its index in the EP group and that group
    (None while ep == 1), and the name DeepSpeed's ZeRO knows the expert groups by."""

    tp: TPContext
    ep_rank: int = 0
    ep: int = 1
    group: Any = None
    group_name: str = ""

    @property
    def splits(self) -> bool:
        return self.tp.size > 1 or self.ep > 1


def mark_expert_shard(param: nn.Parameter, slot: int, ctx: ExpertContext) -> None:
    """A dim-0 piece `slot` of ep x tp pieces. With tp > 1 it is TP-unique (`tensor_model_parallel`, so
    DeepSpeed's gradient norm counts it on every TP rank); with ep > 1 DeepSpeed reduces its gradient over
    the expert-data-parallel group only (`allreduce = False`, `group_name`)."""
    if ctx.tp.size > 1:
        mark_sharded(param, 0)
    param.partition_dim = 0  # type: ignore[attr-defined]
    param.shard_slot = slot  # type: ignore[attr-defined]
    if ctx.ep > 1:
        param.allreduce = False  # type: ignore[attr-defined]
        param.group_name = ctx.group_name  # type: ignore[attr-defined]


def num_experts_of(module: nn.Module) -> int:
    """E, the leading dim every parameter of an experts module shares."""
    sizes = {p.shape[0] for p in module.parameters()}
    if len(sizes) != 1:
        raise ValueError(f"{type(module).__name__}: parameters do not share a leading expert dim ({sorted(sizes)})")
    return sizes.pop()


def shard_experts(module: nn.Module, ctx: ExpertContext) -> ExpertPlacement:
    """Keep this rank's experts of `module` (meta parameters, read later by `materialize`) and install the
    region around its own forward. Returns the placement."""
    placement = ExpertPlacement(num_experts_of(module), tp=ctx.tp.size, ep=ctx.ep)
    slot = placement.slot(ep_rank=ctx.ep_rank, tp_rank=ctx.tp.rank)
    n = placement.per_rank
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            new = nn.Parameter(torch.empty(n, *p.shape[1:], dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
            mark_expert_shard(new, slot, ctx)
            sub._parameters[name] = new
    module.num_experts = n  # type: ignore[assignment]  # the family's forward sizes its one-hot by it and skips id n
    module._is_expert_parallel = True  # type: ignore[assignment]  # transformers' batched kernels mask the sentinel too
    module.forward = _ExpertsRegion(module, module.forward, placement, ctx)  # type: ignore[method-assign]
    return placement


class _ExpertsRegion:
    """The replacement forward (an instance attribute, as transformers' own TP/EP styles install theirs)."""

    def __init__(self, module: nn.Module, forward: Any, placement: ExpertPlacement, ctx: ExpertContext):
        self.module_ref = [module]  # a list keeps the module out of any registry (no cycle in named_modules)
        self.forward, self.placement, self.ctx = forward, placement, ctx
        self.start = placement.bounds(ep_rank=ctx.ep_rank, tp_rank=ctx.tp.rank)[0]

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        tp = self.ctx.tp
        x, w = self.enter(hidden_states, top_k_weights) if tp.size > 1 else (hidden_states, top_k_weights)
        if self.ctx.ep > 1:
            if args or kwargs:
                raise ValueError("expert parallelism runs experts called as (hidden_states, top_k_index, top_k_weights) only")
            out = _exchange(self.forward, x, top_k_index, w, self.placement, tp.rank, self.ctx.group)
        else:
            out = self._local(x, top_k_index, w, *args, **kwargs)
        return tp.exit_region(out) if tp.size > 1 else out

    def enter(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both inputs become per-TP-rank: each rank's routes give a partial gradient of the hidden states
        and of the routing weights (hence of the router), summed over TP backward."""
        training = self.module_ref[0].training
        return self.ctx.tp.enter_region(x, training=training), self.ctx.tp.enter_region(w, training=training)

    def _local(self, x: torch.Tensor, index: torch.Tensor, w: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Routes to other TP ranks' experts become the sentinel n with weight 0 (transformers' AllReduceEP)."""
        n = self.placement.per_rank
        local = index - self.start
        owned = (local >= 0) & (local < n)
        out = self.forward(x, torch.where(owned, local, n), w.masked_fill(~owned, 0.0), *args, **kwargs)
        return _KeepConnected.apply(out, x, w)


class _KeepConnected(torch.autograd.Function):
    """Identity on `out`, zero gradients for the region's inputs. A TP rank none of whose experts is picked
    in a micro-batch returns a constant; without this edge its backward would skip the all-reduces of the
    inputs' gradients (f) that its TP peers run, and the group would hang."""

    @staticmethod
    def forward(ctx, out, *inputs):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


def _exchange(
    forward: Any,
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    placement: ExpertPlacement,
    tp_rank: int,
    group: Any,
) -> torch.Tensor:
    """This TP rank's routes, all-to-all over the EP group to their experts and back (shapes below: T tokens,
    k routes each, h hidden, n experts per rank, g = ep).

    The routes (T * k) whose expert sits in this TP rank's slot of some EP rank are sorted by expert, so by
    destination; per-(destination, expert) counts tell every receiver which expert each row is for."""
    num_routes_per_token = index.shape[-1]
    n, g = placement.per_rank, placement.ep
    ids = index.reshape(-1)  # (T * k,) global expert ids
    mine = torch.nonzero((ids // n) % placement.tp == tp_rank).squeeze(-1)
    order = mine[torch.argsort(ids[mine], stable=True)]  # (m,) routes sent by this rank, by expert
    sorted_ids = ids[order]
    counts = torch.bincount((sorted_ids // n) // placement.tp * n + sorted_ids % n, minlength=g * n).view(g, n)
    recv_counts = exchange_counts(counts, group)  # (g, n): routes each EP peer sends to each of my experts
    send_sizes, recv_sizes = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    tokens = all_to_all(x[order // num_routes_per_token], send_sizes, recv_sizes, group)  # (r, h)
    expert_ids = torch.arange(n, device=x.device).repeat(g).repeat_interleave(recv_counts.reshape(-1))
    unit = torch.ones(tokens.shape[0], 1, dtype=weights.dtype, device=x.device)
    if tokens.shape[0]:
        y = forward(tokens, expert_ids.unsqueeze(-1), unit)
    else:  # keep the empty result on the graph, so this rank still runs both exchanges backward
        y = forward(tokens.sum(0, keepdim=True), expert_ids.new_zeros(1, 1), unit.new_ones(1, 1))[:0]
    back = all_to_all(y, recv_sizes, send_sizes, group)  # (m, h), in `order`
    contrib = back * weights.reshape(-1)[order].unsqueeze(-1)
    return x.new_zeros(x.shape).index_add(0, order // num_routes_per_token, contrib.to(x.dtype))
