"""The one reading of a family's TP plan (`dsx3d.models.tp_plan`): the engine shards exactly what the
estimator counts, for every family with plans, and the interpreter's rules on their own. No processes."""

from __future__ import annotations

import pytest
from torch import nn

from dsx3d.distributed.expert_parallel.experts import _ExpertsRegion
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dsx3d.models import tp_plan
from dsx3d.models.family_spec import resolve_family
from dsx3d.models.known_families import families_with_plans, refusal, tiny_config
from dsx3d.models.pipe_layers import LayerBuilder
from dsx3d.models.shape import model_dim, shape_from_hf_config

FAMILIES = [f for f in families_with_plans() if refusal(f, 2) is None]


@pytest.mark.parametrize("family", FAMILIES)
def test_estimator_counts_what_the_engine_shards(family: str) -> None:
    """Per-layer TP collectives the estimator predicts (mean over layers) equal the engine's own TP layers
    in a tp=2 stage built on the meta device: row-parallel linears (forward all-reduce), modules holding
    column-parallel linears (one entry each: backward all-reduce), replicated parameters with a gradient
    all-reduce, MoE experts regions (output all-reduced forward, input and top-k routing weights backward),
    and with sequence parallelism those the engine marks as running on sequence shards."""
    config = tiny_config(family)
    tp = TPContext(rank=0, size=2, sequence_parallel=True)
    builder = LayerBuilder(config, resolve_family(config), tp, source=None)  # type: ignore[arg-type]
    rows = regions = grads = on_shards = experts = 0
    layers = builder.skeleton.layers
    for i, layer in enumerate(layers):
        builder._shard(layer, f"{builder.plan.layers_name}.{i}")
        rows += sum(isinstance(m, RowParallelLinear) for m in layer.modules())
        regions += len({name.rpartition(".")[0] for name, m in layer.named_modules() if isinstance(m, ColumnParallelLinear)})
        grads += sum(
            p.numel() for m in layer.modules() if getattr(m, "_dsx3d_grad_allreduce", False) for p in m.parameters()
        )
        on_shards += sum(
            p.numel()
            for m in layer.modules()
            if getattr(m, "_dsx3d_on_shards", False)
            for p in m.parameters(recurse=False)
            if not getattr(p, "tensor_model_parallel", False)
        )
        experts += sum(isinstance(vars(m).get("forward"), _ExpertsRegion) for m in layer.modules())
    shape = shape_from_hf_config(config)
    n = len(layers)
    top_k = model_dim(config, "num_experts_per_tok") or 1
    assert (
        shape.tp_forward_allreduces,
        shape.tp_backward_allreduces,
        shape.tp_grad_allreduce_params,
        shape.tp_routing_allreduce_width,
    ) == pytest.approx(((rows + experts) / n, (regions + experts) / n, grads / n, experts * top_k / n))
    assert (shape.sequence_parallel_blocker is None) == tp.sequence_parallel
    if tp.sequence_parallel:
        assert shape.tp_sequence_params == pytest.approx(on_shards / n)


def test_plan_patterns_and_whole_subtrees() -> None:
    plan = {
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise_split_input",
    }
    assert tp_plan.style_for(plan, "layers.12.self_attn.q_proj") == "colwise"
    assert tp_plan.style_for(plan, "layers.1.2.self_attn.q_proj") is None  # `*` is one name component
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(4, 4)
    layer.self_attn.o_proj = nn.Linear(4, 4)
    layer.self_attn.q_norm = nn.LayerNorm(4)
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.Module()
    layer.mlp.experts.down_proj = nn.Linear(4, 4)  # inside an experts module (split as one unit): not visited
    decided = tp_plan.plan_modules(layer, "layers.0", plan, lambda m: isinstance(m, nn.Linear))
    got = {name: sharding.style for name, _, sharding in decided}
    assert got == {
        "mlp.experts": "moe_tp_experts",
        "self_attn.q_proj": "colwise",
        "self_attn.o_proj": "rowwise_split_input",
        "self_attn.q_norm": "replicated_with_grad_allreduce",
    }
    # an implemented linear style on something that is not a linear keeps it whole
    assert tp_plan.keeps_whole("colwise", is_linear=False) and not tp_plan.keeps_whole(None, is_linear=False)
    assert tp_plan.sharding_for("packed_colwise", is_linear=True) is None
