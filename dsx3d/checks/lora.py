"""The checker's rules for `model.lora` (LoRA through peft): what dsx3d trains, and what it refuses.

Adapters go on the linear layers of the decoder layers only (the embedding and LM head stay frozen), one
adapter, no trained biases or extra saved modules, peft's default or random initialisation, ZeRO 0-2.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dsx3d.boundary_types import HFConfig
from dsx3d.checks.context import _Context
from dsx3d.errors import Problem
from dsx3d.recipe.schema import Recipe

UNSUPPORTED = {
    "modules_to_save": "training whole extra modules next to the adapters",
    "layers_to_transform": "adapting only some layers",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "use_dora": "DoRA",
    "lora_bias": "trained adapter biases",
    "trainable_token_indices": "trainable token embeddings",
    "use_rslora": "rank-stabilised scaling",
}


def _meta_layer_linears(hf_config: HFConfig) -> tuple[list[str], list[str]]:
    """(names of nn.Linear modules in decoder layer 0, names of every other module in it)."""
    from torch import nn

    from dsx3d.models.shape import _meta_layers

    _, layers = _meta_layers(hf_config)
    linear: list[str] = []
    other: list[str] = []
    for name, sub in layers[0].named_modules():
        if name:
            (linear if isinstance(sub, nn.Linear) else other).append(name)
    return linear, other


def config_problems(config: Any, key: str) -> Iterator[Problem]:
    """What dsx3d cannot train in a peft config (`key` names where it came from)."""
    for field, what in UNSUPPORTED.items():
        value = getattr(config, field, None)
        if value:
            yield Problem(f"{key}.{field}", value, f"dsx3d does not train {what} with LoRA", f"remove {field} from the peft config")
    if getattr(config, "bias", "none") != "none":
        yield Problem(f"{key}.bias", config.bias, "dsx3d trains no biases with LoRA", "set bias to \"none\"")
    if getattr(config, "init_lora_weights", True) not in (True, False):
        yield Problem(
            f"{key}.init_lora_weights", config.init_lora_weights, "dsx3d initialises LoRA as peft's default (true) or at random (false)",
            "set init_lora_weights to true or false",
        )
    if not isinstance(getattr(config, "target_modules", None), (list, set, tuple)):
        yield Problem(
            f"{key}.target_modules", getattr(config, "target_modules", None), "dsx3d needs the target modules as a list of names",
            "list the layer names, for example [q_proj, v_proj]",
        )


def lora_problems(recipe: Recipe, hf_config: HFConfig | None) -> Iterator[Problem]:
    """Every problem of `recipe.model.lora` (nothing without it)."""
    section = recipe.model.lora
    if section is None:
        return
    key = "model.lora"
    if recipe.zero.stage >= 3:
        yield Problem("zero.stage", recipe.zero.stage, "LoRA is trained with ZeRO stages 0-2 (its optimizer state is tiny)", "set zero.stage: 1")
    config = None
    if section.peft_config is not None:
        from peft import LoraConfig

        try:
            config = LoraConfig.from_pretrained(section.peft_config)
        except Exception as err:
            reason = " ".join(str(err).split())[:200] or type(err).__name__
            yield Problem(f"{key}.peft_config", section.peft_config, f"no readable peft LoraConfig there ({reason})", "point it at a folder holding adapter_config.json")
            return
        yield from config_problems(config, f"{key}.peft_config")
        wanted = config.target_modules if isinstance(config.target_modules, (list, set, tuple)) else []
        target_key = f"{key}.peft_config.target_modules"
    else:
        wanted = section.target_modules
        target_key = f"{key}.target_modules"
    if hf_config is None:
        return
    yield from _stages_without_layers(recipe, hf_config)
    try:
        linear, other = _meta_layer_linears(hf_config)
    except Exception:  # a model that does not build is reported by the model rules
        return
    for name in sorted(wanted):
        hits = [m for m in linear if m == name or m.endswith("." + name)]
        if hits:
            continue
        kind = "is not a linear layer of the decoder layers" if any(m == name or m.endswith("." + name) for m in other) else "names no module of the decoder layers"
        choices = sorted({m.rpartition(".")[2] for m in linear})
        yield Problem(target_key, name, f"{kind} (dsx3d puts adapters on decoder-layer linears only)", f"use some of {choices}")


def _stages_without_layers(recipe: Recipe, hf_config: HFConfig) -> Iterator[Problem]:
    """With LoRA the adapters are a stage's only trainable parameters, and DeepSpeed builds no optimizer over
    none ("optimizer got an empty parameter list", after the process groups exist): every pipeline stage
    needs a decoder layer."""
    pp = recipe.parallel.pp
    if pp == 1:
        return
    from dsx3d.pipeline.split import stage_layers_for

    try:
        split = stage_layers_for(hf_config, pp, recipe.train.seq_len, recipe.parallel.stage_layers)
    except Exception:  # a bad split is reported by the layout rules
        return
    if 0 in split:
        n = sum(split)
        even = [n // pp + (1 if i < n % pp else 0) for i in range(pp)]
        yield Problem(
            "parallel.stage_layers",
            split,
            "with model.lora every pipeline stage needs a decoder layer: the adapters are its only trainable "
            "parameters and DeepSpeed cannot build an optimizer over none",
            f"set parallel.stage_layers: {even}" if 0 not in even else "use fewer pipeline stages (parallel.pp)",
        )


def _lora(c: _Context) -> Iterator[Problem]:
    """model.lora: targets that exist and are decoder-layer linears, a peft config dsx3d can train
    (`lora_problems`), checked before any process starts."""
    yield from lora_problems(c.recipe, c.hf_config)
