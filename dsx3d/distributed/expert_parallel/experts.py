"""A family's own experts module, split over the TP and EP ranks, still running the family's own forward.

Hugging Face MoE blocks call `experts(hidden_states (T, h), top_k_index (T, k), top_k_weights (T, k))` and get
sum_k w_tk * expert_{i_tk}(x_t) back; the experts keep their weights as (E, ...) tensors and skip the sentinel
expert id E (transformers' own expert parallelism sets `num_experts` to the local count and routes other
ranks' experts to it). `shard_experts` keeps a rank's n = E / (ep * tp) experts (`placement`) and replaces
the module's forward with a region:

- tokens are replicated over TP, so no exchange is needed there: each TP rank runs only the routes to its own
  experts and the partial sums are added over TP like a row-parallel layer. The region is entered with
  `TPContext.enter_partial` for the hidden states and the routing weights (their gradients are partial per TP
  rank: all-reduced backward, Megatron's f) and left with `exit_region` (g);
- with ep > 1 the routes of a TP rank's slot go, with their routing weights, to the EP rank holding their
  expert, all-to-all over the EP group (DeepSpeed-MoE, Megatron and torchtitan do the same); the experts run
  them top-1, results come back with a second all-to-all and are summed per token on the sender.

A rank hands its experts only the routes it runs (as rows, each with its expert's local id): routing every
token with the other ranks' experts masked (transformers' AllReduceEP) would keep activations of all k routes
per token on every rank, since its grouped kernels gather every route.

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

    def __init__(self, module: nn.Module, forward: object, placement: ExpertPlacement, ctx: ExpertContext):
        self.module_ref = [module]  # a list keeps the module out of any registry (no cycle in named_modules)
        self.forward, self.placement, self.ctx = forward, placement, ctx

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if args or kwargs:
            raise ValueError("dsx3d splits experts called as (hidden_states, top_k_index, top_k_weights) only")
        tp = self.ctx.tp
        x, w = self.enter(hidden_states, top_k_weights) if tp.size > 1 else (hidden_states, top_k_weights)
        out = _route(self.forward, x, top_k_index, w, self.placement, self.ctx)
        return tp.exit_region(out) if tp.size > 1 else out

    def enter(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both inputs become per-TP-rank: each rank's routes give a partial gradient of the hidden states
        and of the routing weights (hence of the router), summed over TP backward."""
        training = self.module_ref[0].training
        return self.ctx.tp.enter_partial(x, training=training), self.ctx.tp.enter_partial(w, training=training)


def _route(
    forward: Any,
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    placement: ExpertPlacement,
    ctx: ExpertContext,
) -> torch.Tensor:
    """This TP rank's routes through their experts (shapes: T tokens, k routes each, h hidden, n experts per
    rank, g = ep): the routes (T * k) whose expert sits in this TP rank's slot of some EP rank, sorted by
    expert (so by destination), with their routing weights; with ep > 1 exchanged all-to-all over the EP
    group, per-(destination, expert) counts first, so every receiver knows which expert each row is for. The
    family's experts run top-1 on the rows (it weights them itself, as it does unsplit), the results come back
    and are summed per token. Only the routes this rank runs are gathered, so compute and saved activations
    are about k / tp per token, not k (a rank never sees the routes of other TP ranks)."""
    routes_per_token = index.shape[-1]
    n, g, tp_rank = placement.per_rank, placement.ep, ctx.tp.rank
    ids = index.reshape(-1)  # (T * k,) global expert ids
    mine = torch.nonzero((ids // n) % placement.tp == tp_rank).squeeze(-1)
    order = mine[torch.argsort(ids[mine], stable=True)]  # (m,) routes run by this TP rank, by expert
    sorted_ids = ids[order]
    tokens = x[order // routes_per_token]  # (m, h)
    route_weights = weights.reshape(-1)[order].unsqueeze(-1)  # (m, 1)
    if g > 1:
        counts = torch.bincount((sorted_ids // n) // placement.tp * n + sorted_ids % n, minlength=g * n).view(g, n)
        recv_counts = exchange_counts(counts, ctx.group)  # (g, n): routes each EP peer sends to each of my experts
        send_sizes, recv_sizes = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        tokens = all_to_all(tokens, send_sizes, recv_sizes, ctx.group)  # (r, h)
        route_weights = all_to_all(route_weights, send_sizes, recv_sizes, ctx.group)  # (r, 1)
        expert_ids = torch.arange(n, device=x.device).repeat(g).repeat_interleave(recv_counts.reshape(-1))
    else:
        expert_ids = sorted_ids % n
    if tokens.shape[0]:
        y = forward(tokens, expert_ids.unsqueeze(-1), route_weights)
    else:  # keep the empty result on the graph, so this rank still runs every collective backward
        y = forward(tokens.sum(0, keepdim=True), expert_ids.new_zeros(1, 1), route_weights.sum(0, keepdim=True))[:0]
    if g > 1:
        y = all_to_all(y, recv_sizes, send_sizes, ctx.group)  # (m, h), in `order`
    return x.new_zeros(x.shape).index_add(0, order // routes_per_token, y.to(x.dtype))
