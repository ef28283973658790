"""Named types for what crosses into dsx3d from Hugging Face and DeepSpeed.

This module imports nothing of dsx3d, so any package may import it. The classes are imported for the type
checker only (DeepSpeed's import is heavy and sets up its
accelerator), so every alias here is a string at run time: use them in annotations, never in pydantic
fields or `isinstance`. DeepSpeed ships no type information, so its engines read as `Any` to mypy; the
alias still tells a reader which object is meant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import LayerSpec
    from transformers import (
        BaseImageProcessor,
        FeatureExtractionMixin,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        ProcessorMixin,
        TrainingArguments,
    )

__all__ = [
    "Batch",
    "DSCheckpointEngine",
    "DSConfig",
    "DSLayerSpec",
    "DSEngine",
    "HFConfig",
    "HFModel",
    "HFProcessor",
    "HFTrainingArguments",
    "JSONObject",
    "JSONValue",
    "ParamGroup",
    "PipeEngine",
]

JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"
"""A value JSON can hold."""

JSONObject: TypeAlias = "dict[str, JSONValue]"
"""A JSON object (a recipe's model.config, its deepspeed overrides)."""

DSConfig: TypeAlias = "dict[str, JSONValue]"
"""A DeepSpeed config, or overrides for one: the JSON object `deepspeed.initialize(config=...)` reads."""

HFConfig: TypeAlias = "PretrainedConfig"
"""A model's Hugging Face config (any family; attributes are read by name)."""

HFModel: TypeAlias = "PreTrainedModel"
"""A Hugging Face model (possibly on the meta device)."""

HFTrainingArguments: TypeAlias = "TrainingArguments"
"""`transformers.TrainingArguments` (or a TRL subclass of it)."""

DSEngine: TypeAlias = "DeepSpeedEngine"
"""DeepSpeed's engine (`deepspeed.initialize` with pp = 1)."""

PipeEngine: TypeAlias = "PipelineEngine"
"""DeepSpeed's pipeline engine, whose methods dsx3d patches."""

DSLayerSpec: TypeAlias = "LayerSpec"
"""One layer of a DeepSpeed PipelineModule, built on the stage that owns it (a TiedLayerSpec too)."""

DSCheckpointEngine: TypeAlias = "CheckpointEngine"
"""How a DeepSpeed engine writes and reads checkpoint files (torch.save/load or a decoupled writer)."""

HFProcessor: TypeAlias = "PreTrainedTokenizerBase | BaseImageProcessor | FeatureExtractionMixin | ProcessorMixin"
"""A tokenizer or processor, as `Trainer(processing_class=...)` takes it (saved next to an exported model)."""

Batch: TypeAlias = "Mapping[str, torch.Tensor]"
"""A collated batch as a Trainer's data collator hands it over."""

ParamGroup: TypeAlias = "dict[str, Any]"
"""One of a torch optimizer's param groups (torch types them so: "params" plus any setting)."""
