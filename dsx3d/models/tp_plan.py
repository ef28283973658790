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
from typing import Any

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


def plan_modules(
    module: Any, rel_name: str, plan: dict[str, str], is_linear: Callable[[Any], bool]
) -> list[tuple[str, Any, Sharding]]:
    """(name inside `module`, submodule, sharding) for every submodule the plan shards, parents before
    children; `rel_name` is `module`'s name relative to the base model ("layers.3"). Subtrees that
    `keeps_whole` are skipped entirely, and so are the insides of an experts module (split as one unit). The engine swaps in TP layers from this list; the estimator counts
    the same list on a meta-device model, so both read the plan identically."""
    out: list[tuple[str, Any, Sharding]] = []
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
