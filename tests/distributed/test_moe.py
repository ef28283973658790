"""Mixture-of-experts split over TP and EP ranks (dsx3d.distributed.expert_parallel):

- the experts region alone, on 4 forked ranks (ep 2 x tp 2) with a family's own experts module, against the
  same module unsplit: outputs and the gradients of the hidden states, the routing weights and every expert,
  over generated routings (uniform, skewed onto one expert, onto one rank's experts, so that ranks send or
  receive nothing);
- parity with single-process HF through the real engine for MoE families with an auxiliary loss: a CI
  sample of three (shared experts, fused 3D experts with top-2, top-k with a normalised router) at
  (dp, tp, pp) = (1, 2, 2), (2, 2, 2) and ep = 2; `DSX3D_SWEEP=1` runs the whole grid and every MoE family;
- per-rank expert parameters are E / (tp x ep) of each layer's, and the estimator counts exactly that;
- the checker's ep rules, the placement arithmetic (pure).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsx3d.checks import check_recipe
from dsx3d.distributed.expert_parallel.placement import ExpertPlacement
from dsx3d.estimate import Setup, estimate, shape_from_hf_config
from dsx3d.models.known_families import families_with_plans, refusal, tiny_config
from dsx3d.models.moe import experts_per_layer
from dsx3d.plan.layout import Layout
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase, case_recipe, run_parity

SWEEP = bool(os.environ.get("DSX3D_SWEEP"))

# tiny configs with 8 routed experts and their auxiliary (load-balancing) loss on
MODELS = {
    # a shared expert next to the routed ones, with its own sigmoid gate
    "qwen2_moe": lambda: tiny_config("qwen2_moe", num_experts=8, output_router_logits=True),
    # fused 3D expert weights (gate_up_proj (E, 2I, h)), top-2 routing
    "mixtral": lambda: tiny_config("mixtral", num_local_experts=8, output_router_logits=True),
    # top-k with the router's probabilities renormalised over the k picked
    "qwen3_moe": lambda: tiny_config("qwen3_moe", num_experts=8, norm_topk_prob=True, output_router_logits=True),
    # shared experts, a dense first layer, grouped sigmoid routing with a correction bias (no aux loss)
    "glm4_moe": lambda: tiny_config("glm4_moe", n_routed_experts=8),
}
# (dp, tp, pp, ep); pp = 1 runs DeepSpeed's regular engine, experts split over tp only (ep > 1 needs a pipeline)
LAYOUTS = [(1, 2, 2, 1), (2, 2, 2, 1), (2, 2, 2, 2), (2, 1, 2, 2), (2, 2, 1, 1)]
CI_CASES = [
    ("qwen2_moe", (1, 2, 2, 1)),
    ("mixtral", (2, 2, 2, 2)),
    ("qwen3_moe", (2, 1, 2, 2)),
    ("qwen3_moe", (2, 2, 1, 1)),
]
CASES = [(m, lay) for m in MODELS for lay in LAYOUTS] if SWEEP else CI_CASES


# -- pure ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("experts", "tp", "ep"), [(8, 2, 2), (8, 1, 4), (12, 2, 3), (64, 4, 2), (6, 2, 1)])
def test_placement_partitions_the_experts(experts: int, tp: int, ep: int) -> None:
    p = ExpertPlacement(experts, tp=tp, ep=ep)
    ranges = [p.bounds(ep_rank=e, tp_rank=t) for e in range(ep) for t in range(tp)]
    assert ranges == [(i * p.per_rank, (i + 1) * p.per_rank) for i in range(tp * ep)]  # slot order = expert order
    for expert in range(experts):
        e, t = p.owner(expert)
        start, stop = p.bounds(ep_rank=e, tp_rank=t)
        assert start <= expert < stop
    with pytest.raises(ValueError, match="cannot be split evenly"):
        ExpertPlacement(experts + 1, tp=2, ep=2)


def _problems(par: dict[str, Any], gpus: int = 8, **model: Any) -> list[str]:
    config = {"model_type": "mixtral", "num_local_experts": 8, **model}
    recipe = case_recipe(ParityCase(tiny_config("mixtral")))
    recipe = recipe.model_copy(
        update={
            "model": recipe.model.model_copy(update={"config": config}),
            "parallel": recipe.parallel.model_copy(update={"dp": "auto", **par}),
            "cluster": recipe.cluster.model_copy(update={"gpus_per_node": gpus, "nodes": 2}),
        }
    )
    return [f"{p.severity} {p.key}: {p.reason}" for p in check_recipe(recipe) if p.key in ("parallel.ep", "parallel.tp", "zero.stage")]


def test_checker_validates_ep() -> None:
    """ep must divide dp, tp x ep must split the experts, a dense model has nothing to split; an EP group
    leaving the node is a warning. (Without these the engine fails deep inside DeepSpeed, or worse: a
    layout whose EP group is not a block of DP ranks would reduce experts' gradients over the wrong ranks.)"""
    assert _problems({"tp": 2, "pp": 2, "ep": 2}) == []
    assert any("ep must divide dp = 4" in p for p in _problems({"tp": 2, "pp": 2, "ep": 3}))
    assert not any("cannot be split" in p for p in _problems({"tp": 2, "pp": 1, "ep": 4}))  # 8 experts, 1 per rank
    assert any("cannot be split evenly over tp x ep = 2 x 4" in p for p in _problems({"tp": 2, "pp": 1, "ep": 4}, num_local_experts=4))
    assert any(p.startswith("warning parallel.ep") and "crosses nodes" in p for p in _problems({"tp": 2, "pp": 1, "ep": 4}, gpus=4))
    # expert parallelism lives in the pipeline engine: refused at pp = 1, where experts split over tp alone
    assert any("parallel.ep: expert parallelism is built into the pipeline engine" in p for p in _problems({"tp": 2, "pp": 1, "ep": 2}))
    assert _problems({"tp": 2, "pp": 1, "ep": 1}) == []
    dense = case_recipe(ParityCase(tiny_config("llama"), dp=2, ep=2))
    assert any(p.key == "parallel.ep" and "no mixture-of-experts" in p.reason for p in check_recipe(dense))


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_estimator_counts_experts_as_placed(model: str, tp: int, ep: int) -> None:
    """The shape reader counts every parameter of the model once, experts apart; per device the experts of
    a stage are E / (tp x ep) of its layers', and ZeRO partitions their optimizer state over dp / ep."""
    config = MODELS[model]()
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = shape_from_hf_config(config)
    assert shape.total_params == real
    experts = shape.layers_params().experts
    assert experts and experts % (experts_per_layer(config) or 0) == 0
    est = estimate(shape, Setup(dp=4, tp=tp, pp=1, ep=ep, dtype="fp32", seq_len=16))
    assert est.stages[0].expert_params_per_device == pytest.approx(experts / (tp * ep))
    dense = est.stages[0].params_per_device - est.stages[0].expert_params_per_device
    assert est.stages[0].optimizer_gb * 1e9 == pytest.approx(12 * (dense / 4 + experts / (tp * ep) / (4 // ep)))


# -- the experts region alone --------------------------------------------------------------------------------


def _region_rank(rank: int, full: dict[str, torch.Tensor], routings: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    from dsx3d.distributed import comm
    from dsx3d.distributed.expert_parallel.experts import ExpertContext, shard_experts
    from dsx3d.distributed.expert_parallel.groups import create_expert_groups
    from dsx3d.distributed.tensor_parallel.context import TPContext

    layout = Layout(dp=2, tp=2, pp=1, gpus_per_node=4, ep=2)
    tp_groups = [comm.new_group(g) for g in layout.tp_groups()]
    place = layout.placement(rank)
    groups = create_expert_groups(layout.ep_groups(), layout.edp_groups(), rank)
    tp = TPContext(rank=place.tp, size=2, group=tp_groups[rank // 2])
    ctx = ExpertContext(tp, ep_rank=layout.ep_rank(rank), ep=2, group=groups.ep_group, group_name=groups.name)
    experts = _experts_module()
    placement = shard_experts(experts, ctx)
    start, stop = placement.bounds(ep_rank=ctx.ep_rank, tp_rank=place.tp)
    for name, p in experts.named_parameters():
        p.data = full[name][start:stop].clone()
    out = []
    for routing in routings:  # this DP rank's batch: index ep_rank of the routing's two batches
        experts.zero_grad()
        x = routing["x"][ctx.ep_rank].clone().requires_grad_(True)
        w = routing["w"][ctx.ep_rank].clone().requires_grad_(True)
        y = experts(x, routing["index"][ctx.ep_rank], w)
        (y * routing["g"][ctx.ep_rank]).sum().backward()
        grads = {name: p.grad.clone() for name, p in experts.named_parameters()}
        out.append({"y": y.detach(), "x": x.grad, "w": w.grad, "experts": grads, "range": (start, stop)})
    return out


def _experts_module() -> torch.nn.Module:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    module = MixtralExperts(tiny_config("mixtral", num_local_experts=8))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module


def _routings(seed: int) -> list[dict[str, torch.Tensor]]:
    """Two DP batches per routing: uniform, all on one expert, all on experts of EP rank 1 (EP rank 0
    receives nothing), each token's second route on one expert of TP rank 0 (TP rank 1 idle for it)."""
    g = torch.Generator().manual_seed(seed)
    tokens, k, hidden = 6, 2, 32
    kinds = [
        lambda: torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(tokens)]),
        lambda: torch.stack([torch.tensor([3, 3 + 1]) for _ in range(tokens)]),
        lambda: torch.randint(4, 8, (tokens, k), generator=g),
        lambda: torch.stack([torch.tensor([int(torch.randint(0, 8, (1,), generator=g)), 0]) for _ in range(tokens)]),
    ]
    out = []
    for kind in kinds:
        out.append(
            {
                "x": torch.randn(2, tokens, hidden, generator=g),
                "index": torch.stack([kind(), kind()]),
                "w": torch.rand(2, tokens, k, generator=g),
                "g": torch.randn(2, tokens, hidden, generator=g),
            }
        )
    return out


def test_experts_region_matches_the_unsplit_module() -> None:
    full_module = _experts_module()
    full = {n: p.detach().clone() for n, p in full_module.named_parameters()}
    routings = _routings(seed=7)
    results = run_ranks(_region_rank, 4, full, routings)
    layout = Layout(dp=2, tp=2, pp=1, gpus_per_node=4, ep=2)
    for i, routing in enumerate(routings):
        full_module.zero_grad()
        refs = []
        for batch in range(2):
            x = routing["x"][batch].clone().requires_grad_(True)
            w = routing["w"][batch].clone().requires_grad_(True)
            y = full_module(x, routing["index"][batch], w)
            (y * routing["g"][batch]).sum().backward()  # expert grads accumulate over both batches
            refs.append((y.detach(), x.grad, w.grad))
        for rank, result in enumerate(results):
            got, batch = result[i], layout.ep_rank(rank)
            for key, ref in zip(("y", "x", "w"), refs[batch], strict=True):
                torch.testing.assert_close(got[key], ref, atol=1e-5, rtol=1e-5, msg=f"routing {i} rank {rank} {key}")
            start, stop = got["range"]
            for name, grad in got["experts"].items():
                expected = dict(full_module.named_parameters())[name].grad[start:stop]
                torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5, msg=f"routing {i} rank {rank} {name}")


# -- parity with single-process HF ----------------------------------------------------------------------------


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize(("model", "layout"), CASES, ids=lambda v: v if isinstance(v, str) else "dp{}-tp{}-pp{}-ep{}".format(*v))
def test_moe_parity(model: str, layout: tuple[int, int, int, int]) -> None:
    """Losses (the auxiliary loss included), gradient norms and final weights after 3 AdamW steps with
    ZeRO-1 and clipping; the 3D model's experts are E / (tp x ep) per rank."""
    dp, tp, pp, ep = layout
    r = run_parity(ParityCase(MODELS[model](), dp=dp, tp=tp, pp=pp, ep=ep, steps=3))
    assert r.ok, r.to_dict()
    assert r.losses_ref[0] != r.losses_ref[-1]


def _moe_families() -> list[str]:
    out = []
    for family in families_with_plans():
        if refusal(family, 2) is None:
            try:
                if experts_per_layer(tiny_config(family)):
                    out.append(family)
            except Exception:
                continue
    return out


@pytest.mark.usefixtures("warm")
@pytest.mark.skipif(not SWEEP, reason="opt-in: DSX3D_SWEEP=1")
@pytest.mark.parametrize("family", _moe_families() if SWEEP else [])
def test_every_moe_family_with_expert_parallelism(family: str) -> None:
    """Every supported MoE family at (2, 2, 2) with ep = 2 (its own tiny config, experts doubled when 4 do
    not split over tp x ep), its auxiliary loss on where it has one."""
    config = tiny_config(family, output_router_logits=True)
    experts = experts_per_layer(config) or 0
    if experts % 4:
        config = tiny_config(family, output_router_logits=True, **{_experts_key(config): 2 * experts})
    r = run_parity(ParityCase(config, dp=2, tp=2, pp=2, ep=2, steps=2), timeout_s=300)
    assert r.ok, r.to_dict()


def _experts_key(config: Any) -> str:
    return next(k for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts") if hasattr(config, k))
