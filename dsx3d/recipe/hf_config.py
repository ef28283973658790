"""The Hugging Face config of the recipe's model: from `model.config` (train from scratch) or a checkpoint.

The checker needs head counts, layer counts and the vocabulary before any weight exists, so this reads the
config only. Failures become `UserError`s naming the recipe key, never a transformers traceback.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

from dsx3d.errors import Problem, UserError
from dsx3d.recipe.schema import ModelSection


def load_hf_config(model: ModelSection) -> PretrainedConfig:
    """The model's `PretrainedConfig`; raises `UserError` naming `model.config...` or `model.name_or_path`."""
    if model.config is not None:
        return _from_mapping(model.config)
    path = str(model.name_or_path)  # the schema guarantees one of config and name_or_path
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    except Exception as err:  # OSError, ValueError, and transformers' own validation errors
        raise UserError.single(
            "model.name_or_path",
            path,
            f"no readable Hugging Face config there ({_summary(err)})",
            "point it at a local checkpoint directory holding config.json, or use model.config",
        ) from None


def _from_mapping(cfg: dict[str, Any]) -> PretrainedConfig:
    kwargs = dict(cfg)
    model_type = kwargs.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except ValueError as err:
        if "Unrecognized model identifier" in str(err):
            raise UserError.single(
                "model.config.model_type",
                model_type,
                "transformers knows no model of this type",
                "use a model_type of transformers 5.x, for example llama, qwen3 or mistral",
            ) from None
        raise _invalid_config(err) from None
    except Exception as err:  # transformers validates configs with its own (non-ValueError) exception types
        raise _invalid_config(err) from None


def _invalid_config(err: Exception) -> UserError:
    return UserError.single(
        "model.config", None, f"transformers rejects it ({_summary(err)})", "fix model.config"
    )


def _summary(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(err).__name__


# Bounds on the dimensions dsx3d reads. Work such as the stage split grows with the layer count (a dynamic
# programme over layers x stages), so absurd values are refused before anything uses them.
DIM_BOUNDS = {
    "num_hidden_layers": 512,
    "hidden_size": 1 << 20,
    "num_attention_heads": 1 << 16,
    "num_key_value_heads": 1 << 16,
    "intermediate_size": 1 << 24,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 26,
    "head_dim": 1 << 16,
}


def dimension_problems(hf_config: PretrainedConfig, key: str = "model.config") -> list[Problem]:
    """Every dimension of DIM_BOUNDS the config has that is not an integer in [1, bound]."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    problems = []
    for name, bound in DIM_BOUNDS.items():
        try:
            value = getattr(text, name, None)
        except Exception:  # heterogeneous configs refuse global access to per-layer dims
            continue
        if value is None or (name == "head_dim" and value == 0):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            problems.append(
                Problem(
                    f"{key}.{name}",
                    value,
                    f"must be an integer in [1, {bound}]",
                    f"fix {name} in the model's config",
                )
            )
    return problems
