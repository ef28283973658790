"""How dsx3d reads a family's TP plan: the one interpreter, shared by the engine and the estimator (pure).

A Hugging Face `base_model_tp_plan` maps module-name patterns ("layers.*.self_attn.q_proj") to styles. dsx3d
shards on plain tensors the styles below; a module whose style it does not implement (packed projections,
MLA) stays whole on every TP rank together with its children: its input is the full residual stream, so
each TP rank computes the same output and gets the same, full gradient. An MoE experts module
(`moe_tp_experts`) is split by experts over the TP (and expert-parallel) ranks as one unit
(`dsx3d.distributed.expert_parallel`); the plan's styles for its weight tensors are not read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from torch import nn

COLUMN_STYLES = ("colwise", "colwise_gather_output")
"""Output features split over TP; the input gradient is all-reduced (Megatron's f)."""
ROW_STYLES = ("rowwise", "rowwise_split_input")
"""Input features split over TP; the output is all-reduced (Megatron's g), bias added after."""
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
"""A whole parameter on every TP rank that sees only its rank's heads (q/k norms): gradients summed over TP."""

EXPERTS = "moe_tp_experts"
"""An MoE experts module: its (E, ...) weights split by experts; routed tokens in, partial sums out (g)."""

SUPPORTED_TP_STYLES = frozenset({*COLUMN_STYLES, *ROW_STYLES, GRAD_ALLREDUCE, EXPERTS})


@lru_cache(maxsize=4096)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))


def matches(pattern: str, name: str) -> bool:
    """Whether a plan pattern ("layers.*.mlp.up_proj", `*` = one name component) names `name`."""
    return _regex(pattern).fullmatch(name) is not None


def style_for(plan: dict[str, str], name: str) -> str | None:
    """The style of the first plan entry that names `name` (plan order, as transformers reads it)."""
    for pattern, style in plan.items():
        if matches(pattern, name):
            return style
    return None


@dataclass(frozen=True)
class Sharding:
    """What the engine does with one module: split a linear by columns or rows (optionally gathering the
    output / splitting the input), or keep the module whole and sum its parameters' gradients over TP."""

    style: str

    @property
    def column(self) -> bool:
        return self.style in COLUMN_STYLES

    @property
    def row(self) -> bool:
        return self.style in ROW_STYLES

    @property
    def grad_allreduce(self) -> bool:
        return self.style == GRAD_ALLREDUCE

    @property
    def experts(self) -> bool:
        return self.style == EXPERTS

    @property
    def gather_output(self) -> bool:
        return self.style == "colwise_gather_output"

    @property
    def split_input(self) -> bool:
        return self.style == "rowwise_split_input"


def sharding_for(style: str | None, *, is_linear: bool) -> Sharding | None:
    """The engine's decision for a module with plan style `style` (from `applied_plan`). None: the module is
    left as it is; its children may still be sharded, unless `keeps_whole` says otherwise."""
    if style is None or style not in SUPPORTED_TP_STYLES:
        return None
    if style in (GRAD_ALLREDUCE, EXPERTS) or is_linear:
        return Sharding(style)
    return None


def keeps_whole(style: str | None, *, is_linear: bool) -> bool:
    """A module with a style that cannot be applied to it (an implemented linear style on something that is
    not a linear, or an unimplemented style) stays whole on every TP rank, children included."""
    if style is None:
        return False
    return style not in SUPPORTED_TP_STYLES or (style not in (GRAD_ALLREDUCE, EXPERTS) and not is_linear)


Planned: TypeAlias = "tuple[str, Any, Sharding]"
"""(name inside the module, submodule, sharding). The submodule stays `Any`: the engine swaps it for a TP
layer built from it as a Linear, or sets attributes of its own on it."""


def plan_modules(
    module: nn.Module, rel_name: str, plan: dict[str, str], is_linear: Callable[[nn.Module], bool]
) -> list[Planned]:
    """(name inside `module`, submodule, sharding) for every submodule the plan shards, parents before
    children; `rel_name` is `module`'s name relative to the base model ("layers.3"). Subtrees that
    `keeps_whole` are skipped entirely, and so are the insides of an experts module (split as one unit). The engine swaps in TP layers from this list; the estimator counts
    the same list on a meta-device model, so both read the plan identically."""
    out: list[Planned] = []
    whole: list[str] = []
    for sub_name, sub in list(module.named_modules()):
        if any(sub_name.startswith(w + ".") for w in whole):
            continue
        full = f"{rel_name}.{sub_name}" if sub_name else rel_name
        style = style_for(plan, full)
        linear = is_linear(sub)
        if keeps_whole(style, is_linear=linear):
            whole.append(sub_name)
            continue
        sharding = sharding_for(style, is_linear=linear)
        if sharding is not None:
            out.append((sub_name, sub, sharding))
            if sharding.experts:
                whole.append(sub_name)
    return out


def region_modules(shardings: list[Planned]) -> list[str]:
    """Names of the TP regions among `plan_modules`' output: the parents of column-parallel linears
    (attention, MLP), in order. Their input is entered once and their row-parallel outputs leave."""
    out: list[str] = []
    for name, _, sharding in shardings:
        parent = name.rpartition(".")[0]
        if sharding.column and parent not in out:
            out.append(parent)
    return out


def inside(name: str, regions: list[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in regions)


def sequence_shard_params(layer: nn.Module, shardings: list[Planned]) -> list[nn.Parameter]:
    """Replicated parameters of `layer` that see sequence shards under sequence parallelism: those of
    modules outside the TP regions (norms) and the biases of row-parallel linears (added after the
    reduce-scatter), the set the engine all-reduces, one call per tensor and micro-batch
    (`LayerBuilder._shard`). Parameters of whole-kept modules outside the regions count too (such layers
    run without sequence parallelism)."""
    regions = region_modules(shardings)
    styles = {name: sharding for name, _, sharding in shardings}
    found: list[nn.Parameter] = []
    for name, sub in layer.named_modules():
        sharding = styles.get(name)
        if sharding is not None and sharding.row:
            bias = getattr(sub, "bias", None)
            found += [bias] if bias is not None else []
        elif sharding is None and not inside(name, regions):
            found += list(sub.parameters(recurse=False))
    return found


def sequence_parallel_blockers(
    layer: nn.Module, rel_name: str, plan: dict[str, str], is_linear: Callable[[nn.Module], bool]
) -> list[str]:
    """Why sequence parallelism cannot run this decoder layer ([] when it can). Outside the TP regions the
    layer runs on a slice of the sequence, which is right only for token-wise code: dsx3d accepts norms
    there (and parameter-free code), nothing else with parameters. Modules kept whole on every TP rank (MoE
    experts, packed projections) and layers that are their own region are refused too."""
    shardings = plan_modules(layer, rel_name, plan, is_linear)
    regions = region_modules(shardings)
    sharded = {name for name, _, _ in shardings}
    reasons = []
    if "" in regions:
        reasons.append(f"{rel_name} itself holds column-parallel linears (the layer would be one TP region)")
    for name in regions:
        if inside(name, [r for r in regions if r != name]):
            reasons.append(f"{rel_name}.{name} is a TP region inside another one")
    for name, _, sharding in shardings:
        if sharding.experts:
            reasons.append(f"{rel_name}.{name} holds MoE experts, which run on the whole sequence")
        if sharding.row and not inside(name, regions):
            reasons.append(f"{rel_name}.{name} is row-parallel outside any module with column-parallel linears")
    for name, sub in layer.named_modules():
        if not name or inside(name, regions) or name in sharded:
            continue
        if any(True for _ in sub.parameters(recurse=False)) and "norm" not in type(sub).__name__.lower():
            reasons.append(
                f"{rel_name}.{name} ({type(sub).__name__}) has parameters outside the TP regions, so it would "
                "run on a slice of the sequence"
            )
    return reasons


def sequence_parallel_blocker(
    layers: list[nn.Module], layers_name: str, plan: dict[str, str], is_linear: Callable[[nn.Module], bool]
) -> str | None:
    """The first reason (`sequence_parallel_blockers`) over a model's decoder layers, or None: every layer
    must allow it, because every pipeline stage must agree on the shape of its messages."""
    for i, layer in enumerate(layers):
        reasons = sequence_parallel_blockers(layer, f"{layers_name}.{i}", plan, is_linear)
        if reasons:
            return reasons[0]
    return None
