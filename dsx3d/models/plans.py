"""What a family's own plans say: where the embedding, decoder layers, final norm and head live, and how
each linear is sharded. Families are driven by `base_model_pp_plan` / `base_model_tp_plan` from their
configs; only families whose plans leave a gap need an entry in `EXTRA_PLANS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoModelForCausalLM, PretrainedConfig

from dsx3d.errors import UserError
from dsx3d.tp_styles import SUPPORTED_TP_STYLES


@dataclass(frozen=True)
class FamilyPlan:
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
        for pattern, style in self.tp_plan.items():
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), base_relative_name):
                return style
        return None

    def unsupported_tp_styles(self) -> set[str]:
        return set(self.tp_plan.values()) - SUPPORTED_TP_STYLES


# Families whose configs declare no plans, given explicitly: model_type -> (pp plan, tp plan).
EXTRA_PLANS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}

# Gaps in a family's own TP plan: parameters that see TP-sharded activations but are not declared.
EXTRA_TP_STYLES: dict[str, dict[str, str]] = {
    # xIELU activation with learned scalars, applied to the column-parallel MLP activations
    "apertus": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
}


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
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def resolve_family(config: PretrainedConfig) -> FamilyPlan:
    """Read the family's plans; raise a UserError naming the family if they cannot drive a pipeline."""
    pp_plan = getattr(config, "base_model_pp_plan", None)
    tp_plan = getattr(config, "base_model_tp_plan", None) or {}
    if not pp_plan and config.model_type in EXTRA_PLANS:
        pp_plan, tp_plan = EXTRA_PLANS[config.model_type]
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
    return FamilyPlan(
        model_type=config.model_type,
        lm_class=lm_class,
        base_prefix=lm_class.base_model_prefix,
        embed_name=embed_names[0],
        layers_name=layers,
        epilogue_names=tuple(n for n in names[names.index(layers) + 1 :] if pp_plan[n][0] == ["hidden_states"]),
        head_name=next(iter(head_plan)),
        tp_plan={**tp_plan, **EXTRA_TP_STYLES.get(config.model_type, {})},
        tied=is_tied(config),
    )
