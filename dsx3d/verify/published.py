"""A config written as a published HF checkpoint is: weights cast to bf16, `config.dtype` bfloat16, saved as
safetensors shards with `model.safetensors.index.json` (tied heads written once), then read back exactly as
`dsx3d verify --model DIR` reads it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

SHARDS = 4
"""Shards to aim for: a size limit of a quarter of the model (one tensor larger than it gets its own)."""


def save_published(config: PretrainedConfig, out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=max(1, size // SHARDS))
    return out


def load_as_verify(path: Path) -> tuple[PretrainedConfig, torch.nn.Module, dict[str, float]]:
    """(config, fp32 model, dropout turned off) through verify's own `--model` path."""
    from dsx3d.verify.model_source import config_and_model

    config, model, dropped = config_and_model(argparse.Namespace(model=str(path), config=None, arch=None))
    return config, model, dropped


def published_inputs(config: PretrainedConfig, out: Path, seed: int = 0) -> tuple[PretrainedConfig, Any]:
    config_read, model, _ = load_as_verify(save_published(config, out, seed))
    return config_read, model
