"""A dimension of the text model (heads, layers, vocabulary, experts) read from any family's config under its own spelling."""

from __future__ import annotations

from dsx3d.boundary_types import HFConfig

# Attribute spellings across families (gpt2 says n_head, falcon num_kv_heads, ...), first present wins.
_ATTRIBUTE_NAMES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim"),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "moe_k"),
}


def text_config(config: HFConfig) -> HFConfig:
    """The language model's config: multimodal configs nest it (`get_text_config`), plain ones are it."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_dim(config: HFConfig, name: str) -> int | None:
    """One dimension of the text model (`num_attention_heads`, ...) under any family's spelling, or None."""
    text = text_config(config)
    for attr in _ATTRIBUTE_NAMES.get(name, (name,)):
        try:
            value = getattr(text, attr, None)
        except Exception:  # heterogeneous configs refuse global access to per-layer dims
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
