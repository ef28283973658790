"""What a family's own plans say: where the embedding, decoder layers, final norm and head live, and how
each linear is sharded. Families are driven by `base_model_pp_plan` / `base_model_tp_plan` from their
configs; only families whose plans leave a gap need an entry in `dsx3d.models.known_families`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import AutoModelForCausalLM, PretrainedConfig

from dsx3d.errors import UserError
from dsx3d.models import tp_plan
from dsx3d.models.known_families import EXTRA_PLANS, declared_tp_plan
from dsx3d.models.shape import text_config


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    lm_class: Any
    base_prefix: str
    """Attribute of the CausalLM that holds the base model ("model", "gpt_neox", ...)."""
    embed_name: str
    layers_name: str
    epilogue_names: tuple[str, ...]
    """Base-model modules applied after the last decoder layer (the final norm), in order."""
    head_name: str
    tp_plan: dict[str, str] = field(default_factory=dict)
    tied: bool = False

    def tp_style(self, base_relative_name: str) -> str | None:
        """The plan's style for a module name relative to the base model ("layers.3.mlp.up_proj")."""
        return tp_plan.style_for(self.tp_plan, base_relative_name)

    def unsupported_tp_styles(self) -> set[str]:
        return set(self.tp_plan.values()) - tp_plan.SUPPORTED_TP_STYLES


def _lm_class(config: PretrainedConfig) -> Any:
    mapping = AutoModelForCausalLM._model_mapping  # type: ignore[attr-defined]
    try:
        return mapping[type(config)]
    except KeyError:
        raise UserError.single(
            "model.config.model_type", config.model_type, "no causal-LM class for this family in transformers",
            "use a decoder-only causal LM family (llama, qwen3, mistral, gemma, ...)",
        ) from None


def is_tied(config: PretrainedConfig) -> bool:
    text = text_config(config)
    return bool(getattr(text, "tie_word_embeddings", False))


def resolve_family(config: PretrainedConfig) -> FamilySpec:
    """Read the family's plans; raise a UserError naming the family if they cannot drive a pipeline."""
    pp_plan = getattr(config, "base_model_pp_plan", None)
    styles = declared_tp_plan(config)
    if not pp_plan and config.model_type in EXTRA_PLANS:
        pp_plan, styles = EXTRA_PLANS[config.model_type]
    if not pp_plan:
        raise UserError.single(
            "model.config.model_type", config.model_type,
            "this family declares no base_model_pp_plan, so dsx3d cannot split it into pipeline stages",
            "pick a family with plans (see README: supported families)",
        )
    lm_class = _lm_class(config)
    names = list(pp_plan)
    layer_names = [n for n in names if pp_plan[n][0] and pp_plan[n][0][0] == "hidden_states" and "attention_mask" in pp_plan[n][0]]
    embed_names = [n for n in names if pp_plan[n][0] == ["input_ids"]]
    if len(layer_names) != 1 or len(embed_names) != 1:
        raise UserError.single(
            "model.config.model_type", config.model_type,
            f"its pp plan {names} does not have one embedding and one decoder-layer list",
            "pick a family with a standard decoder pp plan",
        )
    layers = layer_names[0]
    head_plan = getattr(lm_class, "_pp_plan", None) or {"lm_head": None}
    return FamilySpec(
        model_type=config.model_type,
        lm_class=lm_class,
        base_prefix=lm_class.base_model_prefix,
        embed_name=embed_names[0],
        layers_name=layers,
        epilogue_names=tuple(n for n in names[names.index(layers) + 1 :] if pp_plan[n][0] == ["hidden_states"]),
        head_name=next(iter(head_plan)),
        tp_plan=styles,
        tied=is_tied(config),
    )
