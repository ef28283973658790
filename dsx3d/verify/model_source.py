"""What `dsx3d verify` compares: the HF config and model it reads from `--model`, `--config` or `--arch`, checked
for size, with dropout turned off."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dsx3d.boundary_types import HFConfig
from dsx3d.errors import UserError

MAX_VERIFY_PARAMS = 2e9


def config_and_model(args: argparse.Namespace) -> tuple[HFConfig, Any, dict[str, float]]:
    """(config, fp32 model or None, dropout turned off) from `args.model` (an HF checkpoint directory),
    `args.config` (a config file or directory) or `args.arch` (a family's built-in tiny config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsx3d.models.known_families import tiny_config

    if args.model or args.config:
        key, value = ("--model", args.model) if args.model else ("--config", args.config)
        path = Path(value)
        if not path.exists() or (args.model and not path.is_dir()):
            what = "an HF checkpoint directory" if args.model else "an HF config JSON file (any name) or a directory holding config.json"
            raise UserError.single(key, value, "not found" if not path.exists() else "not a directory", f"pass {what}")
        try:
            config = AutoConfig.from_pretrained(str(path))  # a JSON file of any name, or a directory
        except Exception as err:  # transformers raises OSError, ValueError, JSONDecodeError, its own types
            raise UserError.single(key, value, f"transformers cannot read this config ({_summary(err)})", "pass a valid HF config") from None
        _check_size(key, value, config)
        dropped = _without_dropout(config)
        if not args.model:
            return config, None, dropped
        from dsx3d.checkpoint.hf.source import checkpoint_source

        # Every file, tensor name and shape is checked before from_pretrained reads anything: a truncated or
        # mismatched checkpoint is one UserError naming the files, never a loader traceback.
        checkpoint_source(str(path), config).release()
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype="float32")
        except Exception as err:
            raise UserError.single(key, value, f"transformers cannot load this checkpoint ({_summary(err)})", "pass a complete HF checkpoint") from None
        return config, model, dropped
    arch = args.arch or "llama"
    try:
        config = tiny_config(arch)
    except Exception:  # KeyError, ValueError, transformers' own validation errors
        raise UserError.single("--arch", arch, "unknown model family", "use a transformers model_type such as llama, qwen3, mistral") from None
    return config, None, _without_dropout(config)


def _check_size(option: str, value: str, config: HFConfig) -> None:
    """verify trains copies of the model on this machine: sizes in bounds, small models only."""
    from dsx3d.models.shape import shape_from_hf_config
    from dsx3d.recipe.hf_config import dimension_problems

    problems = dimension_problems(config, option)
    if problems:
        raise UserError(problems)
    params = shape_from_hf_config(config).total_params
    if params > MAX_VERIFY_PARAMS:
        raise UserError.single(
            option, value, f"{params / 1e9:.1f}B parameters; verify trains copies of the model on this machine",
            f"use a model of at most {MAX_VERIFY_PARAMS / 1e9:g}B parameters (or a smaller config of the family)",
        )


def _summary(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:300]


def _without_dropout(config: HFConfig) -> dict[str, float]:
    """Dropout set to 0: single-process HF and the ranks cannot draw the same masks (the ranks draw per TP
    region), so verify compares the deterministic model. Returns what was turned off."""
    from dsx3d.models.shape import dropout_probabilities, text_config

    dropped = dropout_probabilities(config)
    for key in dropped:
        setattr(text_config(config), key, 0.0)
    return dropped
