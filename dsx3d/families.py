"""Tiny configs for every causal-LM family whose config ships pipeline and TP plans, and the families
dsx3d refuses (with the reason), so support is a measured list rather than a claim."""

from __future__ import annotations

from typing import Any

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Small dimensions applied to whichever of these keys a family's config has.
TINY_DIMS: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    # multi-head latent attention (DeepSeek-style): head_dim = qk_nope_head_dim + qk_rope_head_dim
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
}


def families_with_plans() -> list[str]:
    """model_types with a causal-LM class whose config declares both base_model_pp_plan and _tp_plan."""
    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            cls = CONFIG_MAPPING[model_type]
        except (KeyError, ValueError):
            continue
        if getattr(cls, "base_model_pp_plan", None) and getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """The family's default config shrunk to TINY_DIMS (only keys it has), without dropout (parity needs
    determinism) and with special token ids inside the tiny vocabulary, plus `overrides`.

    A TINY_DIMS key the family's validation rejects (e.g. kv heads that must equal heads) is left at its
    default."""
    defaults = AutoConfig.for_model(model_type).to_dict()
    kwargs: dict[str, Any] = {k: v for k, v in TINY_DIMS.items() if k in defaults}
    for key, value in defaults.items():
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
            kwargs[key] = 0.0
    vocab = overrides.get("vocab_size", kwargs.get("vocab_size", defaults.get("vocab_size")))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(defaults.get(key), int) and vocab is not None and defaults[key] >= vocab:
            kwargs[key] = 0
    kwargs.update(overrides)
    for _ in range(len(kwargs)):
        try:
            return AutoConfig.for_model(model_type, **kwargs)
        except Exception as err:  # drop the first tiny dimension the family refuses, keep the rest
            culprit = next((k for k in TINY_DIMS if k in kwargs and k not in overrides and k in str(err)), None)
            if culprit is None:
                raise
            kwargs.pop(culprit)
    return AutoConfig.for_model(model_type, **kwargs)


# Families refused after the parity sweep, with the reason (tests/test_families.py keeps this honest):
# key -> (reason, refused only when tp > 1).
REFUSED: dict[str, tuple[str, bool]] = {}


def refusal(model_type: str, tp: int) -> str | None:
    """Why dsx3d refuses `model_type` at this tp, or None when it is supported."""
    entry = REFUSED.get(model_type)
    if entry is None or (entry[1] and tp == 1):
        return None
    return entry[0]
