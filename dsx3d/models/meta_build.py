"""Building a config's model on the meta device: its parameter names and shapes without memory, and what stops sequence parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsx3d.boundary_types import HFConfig, HFModel
from dsx3d.errors import UserError
from dsx3d.models import tp_plan
from dsx3d.models.config_dims import text_config

if TYPE_CHECKING:
    from torch import nn

    from dsx3d.models.family_spec import FamilySpec

# Words of transformers' and torch's construction errors -> the config key behind them.
_ERROR_KEYS = {"padding_idx": "pad_token_id", "num_embeddings": "vocab_size"}


def build_meta_model(config: HFConfig) -> HFModel:
    """The family's causal LM built from `config` on the meta device (no memory; about 0.3 s for 70B). A
    config transformers accepts but cannot build (a pad_token_id outside the vocabulary, ...) raises a
    `UserError` naming the key."""
    import torch

    from dsx3d.models.family_spec import resolve_family

    spec = resolve_family(config)
    try:
        with torch.device("meta"):
            return spec.lm_class._from_config(config)
    except Exception as err:  # transformers and torch raise assertions, ValueErrors, TypeErrors here
        message = " ".join(str(err).split()) or type(err).__name__
        keys = [k for k in text_config(config).to_dict() if k in message]
        keys += [key for word, key in _ERROR_KEYS.items() if word in message.lower()]
        key = f"model.config.{keys[0]}" if keys else "model.config"
        value = getattr(text_config(config), keys[0], None) if keys else None
        raise UserError.single(
            key,
            value,
            f"transformers cannot build the model from this config ({message[:300]})",
            f"fix {key}",
        ) from None


def _meta_layers(config: HFConfig) -> tuple[Any, list[Any]]:
    """(FamilySpec, the decoder layers of a meta-device model of `config`): no memory, and fast even at 70B."""
    from dsx3d.models.family_spec import resolve_family

    spec = resolve_family(config)
    lm = build_meta_model(config)
    return spec, list(getattr(getattr(lm, spec.base_prefix), spec.layers_name))


_ATTENTION_FACTS: dict[str, tuple[str | None, bool]] = {}
"""(attention_sinks, attention_heads_split) by config JSON: the planner checks many layouts of one model."""


def _attention_facts(config: HFConfig) -> tuple[str | None, bool]:
    key = config.to_json_string(use_diff=False)
    if key not in _ATTENTION_FACTS:
        if len(_ATTENTION_FACTS) > 64:
            _ATTENTION_FACTS.clear()
        spec, layers = _meta_layers(config)
        _ATTENTION_FACTS[key] = (_attention_sinks(layers), _attention_heads_split(spec, layers))
    return _ATTENTION_FACTS[key]


def attention_sinks(config: HFConfig) -> str | None:
    """The class of a decoder-layer module holding learned per-head attention sinks, or None
    (`_attention_sinks`)."""
    return _attention_facts(config)[0]


def attention_heads_split(config: HFConfig) -> bool:
    """Whether TP splits the attention heads (`_attention_heads_split`)."""
    return _attention_facts(config)[1]


def _attention_sinks(layers: list[nn.Module]) -> str | None:
    """The class of a decoder-layer module holding learned per-head attention sinks (a `sinks` or `s_aux`
    parameter that the attention function reads per head), or None: found on the meta model, whether or not
    the family's TP plan names it."""
    import torch

    for layer in layers:
        for module in layer.modules():
            if any(isinstance(getattr(module, key, None), torch.Tensor) for key in ("sinks", "s_aux")):
                return type(module).__name__
    return None


def _attention_heads_split(spec: FamilySpec, layers: list[nn.Module]) -> bool:
    """Whether TP splits the attention heads (a projection of the attention module planned `colwise`), as
    the engine shards it; False where the plan keeps attention whole or gathers its projections' outputs,
    so that every TP rank attends over all heads."""
    from torch import nn

    from dsx3d.hf_modules import attention_modules

    attention = {id(m) for m in attention_modules(layers[0])}
    for name, module in layers[0].named_modules():
        if id(module) in attention:
            prefix = f"{spec.layers_name}.0.{name}"
            return any(
                isinstance(sub, nn.Linear) and tp_plan.style_for(spec.tp_plan, f"{prefix}.{child}") == "colwise"
                for child, sub in module.named_modules()
            )
    return True


def sequence_parallel_blocker(config: HFConfig) -> str | None:
    """Why the engine runs this model without sequence parallelism even when the recipe asks for it
    (`dsx3d.models.tp_plan.sequence_parallel_blocker`, what the engine's builder checks), or None."""
    from torch import nn

    spec, layers = _meta_layers(config)
    return tp_plan.sequence_parallel_blocker(
        layers, spec.layers_name, spec.tp_plan, lambda m: isinstance(m, nn.Linear)
    )
