"""Tensor-parallel communication per layer: the bytes each TP collective moves for a model shape."""

from __future__ import annotations

from dataclasses import dataclass

from dsx3d.boundary_types import HFConfig
from dsx3d.models import tp_plan
from dsx3d.models.config_dims import model_dim
from dsx3d.models.meta_build import _meta_layers


@dataclass(frozen=True)
class TPTraffic:
    """What one decoder layer sends over TP per micro-batch, in units the timing model scales by b*s (means
    over the layers, so fractional for families that mix layer kinds). Defaults: a Llama layer."""

    forward_allreduces: float = 2
    backward_allreduces: float = 2
    grad_allreduce_params: float = 0
    forward_gather_width: float = 0
    backward_gather_width: float = 0
    routing_allreduce_width: float = 0
    sequence_params: float = 0
    sequence_parallel_blocker: str | None = None
    grad_allreduce_tensors: float = 0
    """Calls, where the fields above count bytes: the q/k-norm-like tensors all-reduced one by one, ..."""
    sequence_tensors: float = 0
    """... the sequence-sharded replicated tensors (norms, row biases), ..."""
    forward_gathers: float = 0
    """... the `colwise_gather_output` linears, and ..."""
    backward_gathers: float = 0
    """... the `rowwise_split_input` linears."""


def tp_traffic(config: HFConfig) -> TPTraffic:
    """A decoder layer's TP traffic as the engine shards it: the family's TP plan read by the engine's own
    interpreter (`dsx3d.models.tp_plan.plan_modules`) over the layers of a meta-device model (no memory;
    about 0.3 s for a 70B model). Row-parallel linears all-reduce their output forward; the column-parallel
    linears of one module (a TP region: attention, MLP) read one input and all-reduce its gradient once,
    backward; `colwise_gather_output` also all-gathers its output forward, `rowwise_split_input` its input
    gradient backward; `replicated_with_grad_allreduce` modules (q/k norms) all-reduce their weight
    gradient; an experts region all-reduces its output forward, its input and its routing weights'
    gradients backward. Modules kept whole (packed projections) send nothing. Families that mix layer
    kinds (linear and full attention, dense and MoE MLPs) get the mean over their layers. A family the
    engine cannot resolve gets a Llama layer's traffic.

    One entry per region module is what the engine does when each module reads its own input; layers that
    feed one tensor to two modules (parallel attention and MLP: phi, cohere) share one entry at run time,
    and a column-parallel linear on a tensor computed inside its module gets its own: there the count is an
    upper bound, respectively a lower one (scripts/bench/comm.py --sweep measures every family)."""
    try:
        return _tp_traffic(config)
    except Exception:  # families without plans, or whose models cannot be built from this config
        return TPTraffic()


def _tp_traffic(config: HFConfig) -> TPTraffic:
    from torch import nn

    spec, layers = _meta_layers(config)
    top_k = model_dim(config, "num_experts_per_tok") or 1
    fwd = bwd = grad = fwd_gather = bwd_gather = seq = routing = 0
    grad_calls = seq_calls = fwd_gathers = bwd_gathers = 0
    for i, layer in enumerate(layers):
        shardings = tp_plan.plan_modules(
            layer, f"{spec.layers_name}.{i}", spec.tp_plan, lambda m: isinstance(m, nn.Linear)
        )
        regions = tp_plan.region_modules(shardings)
        bwd += len(regions)
        shard_params = tp_plan.sequence_shard_params(layer, shardings)
        seq += sum(p.numel() for p in shard_params)
        seq_calls += len(shard_params)
        for _, sub, sharding in shardings:
            if sharding.grad_allreduce:
                grad += sum(p.numel() for p in sub.parameters())
                grad_calls += len(list(sub.parameters()))
            elif sharding.experts:
                fwd, bwd, routing = fwd + 1, bwd + 1, routing + top_k
            elif sharding.row:
                fwd += 1
                bwd_gather += sub.in_features if sharding.split_input else 0
                bwd_gathers += 1 if sharding.split_input else 0
            else:
                fwd_gather += sub.out_features if sharding.gather_output else 0
                fwd_gathers += 1 if sharding.gather_output else 0
    n = len(layers)
    blocker = tp_plan.sequence_parallel_blocker(
        layers, spec.layers_name, spec.tp_plan, lambda m: isinstance(m, nn.Linear)
    )
    return TPTraffic(
        fwd / n, bwd / n, grad / n, fwd_gather / n, bwd_gather / n, routing / n, seq / n, blocker,
        grad_calls / n, seq_calls / n, fwd_gathers / n, bwd_gathers / n,
    )
