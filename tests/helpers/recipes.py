"""A tiny Llama recipe for tests and examples: two layers, a 512-token vocabulary, fp32; trains on CPU in
seconds. `tiny_recipe_dict(**sections)` deep-merges the given sections over it."""

from __future__ import annotations

import copy
from typing import Any

from dsx3d.recipe.ds_config import deep_merge

TINY_LLAMA: dict[str, Any] = {
    "model": {
        "config": {
            "model_type": "llama",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "vocab_size": 512,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
        }
    },
    "parallel": {"dp": 1, "tp": 2, "pp": 2},
    "cluster": {"nodes": 1, "gpus_per_node": 4},
    "train": {
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "steps": 6,
        "seq_len": 32,
        "lr": 3e-3,
        "warmup_steps": 1,
        "dtype": "fp32",
        "log_interval": 1,
    },
    "data": {"tokenizer_vocab_size": 512},
}


def tiny_recipe_dict(**sections: Any) -> dict[str, Any]:
    """TINY_LLAMA with `sections` merged in (mappings key by key, anything else replaces)."""
    return deep_merge(copy.deepcopy(TINY_LLAMA), sections)
