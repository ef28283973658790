"""What dsx3d reads from a mixture-of-experts family: its experts modules (the plan's `moe_tp_experts`) and,
when the family adds an auxiliary (load-balancing) loss, the router outputs that loss is computed from.

Auxiliary loss across pipeline stages. With `output_router_logits`, a family's base model records each MoE
layer's router logits (`_can_record_outputs["router_logits"]`) and its CausalLM forward turns the tuple into
`aux_loss` (`load_balancing_loss_func`, which couples all layers: expert counts and mean router
probabilities are averaged over every layer before they are multiplied) and adds `coef * aux_loss` to the
loss. The layers live on different stages, so each stage appends its layers' router logits to a tensor
(layers so far, *logits shape) that travels with the hidden states, and the last stage hands the tuple to
the family's own CausalLM forward, whose loss function is swapped for a zero: what it returns as `loss` is
then exactly what the family adds to the language-model loss, computed by the family's code. The router's
gradient flows back through the travelling tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dsx3d.boundary_types import HFConfig
from dsx3d.errors import UserError
from dsx3d.models.shape import model_dim, text_config


def experts_per_layer(config: HFConfig) -> int | None:
    """E, the experts of each MoE layer, for a family whose plan names an experts module (`moe_tp_experts`,
    which dsx3d splits over TP and EP); None for a dense model."""
    from dsx3d.models import tp_plan
    from dsx3d.models.known_families import declared_tp_plan

    if tp_plan.EXPERTS not in declared_tp_plan(config).values():
        return None
    return model_dim(config, "num_experts")


def valid_expert_splits(num_experts: int, tp_choices: list[int], ep_choices: list[int]) -> list[tuple[int, int]]:
    """(tp, ep) pairs whose tp x ep ranks split `num_experts` evenly."""
    return [(t, e) for t in tp_choices for e in ep_choices if num_experts % (t * e) == 0]


def adds_auxiliary_loss(config: HFConfig, skeleton: Any) -> bool:
    """Whether the family's CausalLM adds a loss computed from recorded router logits in this configuration
    (`output_router_logits` on, `_can_record_outputs["router_logits"]` declared, and the forward's loss
    depends on them). The last is probed by running the head on meta tensors (no memory, no FLOPs)."""
    declared = getattr(type(skeleton.base), "_can_record_outputs", None) or {}
    if not (getattr(text_config(config), "output_router_logits", False) and "router_logits" in declared):
        return False
    experts, hidden = model_dim(config, "num_experts"), model_dim(config, "hidden_size")
    logits = torch.zeros(1, 4, experts or 1, device="meta", requires_grad=True)
    try:
        _, extra = skeleton.head(
            torch.zeros(1, 4, hidden or 1, device="meta"), torch.zeros(1, 4, dtype=torch.long, device="meta"), logits
        )
    except Exception as err:  # a family whose head cannot run on meta tensors: say so rather than guess
        raise UserError.single(
            "model.config.output_router_logits",
            True,
            f"dsx3d cannot tell how this family's auxiliary loss uses its router logits ({type(err).__name__}: {err})",
            "set output_router_logits: false (no auxiliary loss), or use a family whose aux loss dsx3d supports",
        ) from None
    return extra is not None and extra.requires_grad


def _router_specs(base: nn.Module) -> list[Any]:
    """The base model's recorder specs for router logits, normalised as transformers does."""
    from transformers.utils.output_capturing import OutputRecorder

    specs = type(base)._can_record_outputs["router_logits"]  # type: ignore[attr-defined]
    out = []
    for spec in specs if isinstance(specs, list) else [specs]:
        if not isinstance(spec, OutputRecorder):
            name = spec if isinstance(spec, str) else None
            spec = OutputRecorder(target_class=None if name else spec, index=1, class_name=name)  # type: ignore[arg-type]
        out.append(spec)
    return out


def router_modules(base: nn.Module, layer: nn.Module, layer_name: str) -> list[tuple[nn.Module, int]]:
    """(module, output index) of the router(s) inside one decoder layer, matched as transformers' output
    capturing matches them (class, class-name suffix, optional layer name)."""
    found = []
    for name, module in layer.named_modules():
        full = f".{layer_name}.{name}" if name else f".{layer_name}"
        for spec in _router_specs(base):
            by_class = spec.target_class is not None and isinstance(module, spec.target_class)
            by_name = spec.class_name is not None and full.endswith(spec.class_name)
            if (by_class or by_name) and (
                spec.layer_name is None or f".{spec.layer_name.strip('.')}." in full + "."
            ):
                found.append((module, spec.index))
    return found


@contextlib.contextmanager
def capture_router_logits(routers: list[tuple[nn.Module, int]]) -> Iterator[list[torch.Tensor]]:
    """Collect what the routers output during the block, in call order."""
    seen: list[torch.Tensor] = []

    def hook(index: int) -> Callable[[nn.Module, tuple[object, ...], Any], None]:
        def record(module: nn.Module, args: tuple[object, ...], output: Any) -> None:
            value = output[index] if isinstance(output, tuple) else output
            if value is not None:
                seen.append(value)

        return record

    handles = [module.register_forward_hook(hook(index)) for module, index in routers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def append_router_logits(carried: torch.Tensor | None, new: list[torch.Tensor]) -> torch.Tensor | None:
    """The travelling (layers so far, *logits shape) tensor with this layer's router logits appended."""
    if not new:
        return carried
    stacked = torch.stack(new)
    return stacked if carried is None else torch.cat([carried, stacked.to(carried.dtype)])


def no_lm_loss(logits: torch.Tensor, labels: object, *args: object, **kwargs: object) -> torch.Tensor:
    """Stands in for the family's language-model loss on the last stage, which dsx3d computes on vocab
    shards itself: what the family's forward returns as `loss` is then its auxiliary terms alone."""
    return torch.zeros((), dtype=torch.float32, device=logits.device)
