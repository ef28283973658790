"""The checker's rules for `train.objective` and DPO from a recipe (`train.dpo`, data.format preference): which
objective fits which data, the loss types computed per pair (dsx3d.objectives.dpo_math), the reference a model
can have, and what the reference pass cannot run under."""

from __future__ import annotations

from collections.abc import Iterator

from dsx3d.checks.context import _Context
from dsx3d.errors import Problem

FORMATS = {"lm": ("text",), "sft": ("chat", "instruction"), "dpo": ("preference",)}
"""The data.format values each train.objective trains on."""


def objective_problems(c: _Context) -> Iterator[Problem]:
    recipe = c.recipe
    train, data = recipe.train, recipe.data
    objective = train.objective
    if objective is not None and data.format not in FORMATS[objective]:
        fits = " or ".join(FORMATS[objective])
        yield Problem("train.objective", objective, f"it trains on data.format {fits}, and data.format is {data.format}",
                      f"set data.format: {FORMATS[objective][0]} (with data of that shape), or set train.objective to "
                      f"{next(k for k, v in FORMATS.items() if data.format in v)}")  # fmt: skip
        return
    if data.format != "preference":
        return
    yield from _dpo_problems(c)


def _dpo_problems(c: _Context) -> Iterator[Problem]:
    from dsx3d.objectives.dpo_math import PAIR_LOSSES

    recipe = c.recipe
    dpo = recipe.train.dpo
    lora = recipe.model.lora
    weights = dpo.loss_weights if dpo.loss_weights is not None else [1.0] * len(dpo.loss_type)
    from dsx3d.objectives.dpo_math import DPOLossConfig

    config = DPOLossConfig(loss_type=tuple(dpo.loss_type), loss_weights=tuple(float(w) for w in weights))
    for key, value, why in config.unsupported():
        fix = f"use one of {', '.join(PAIR_LOSSES)}" if key == "loss_type" else "give one weight per loss type"
        yield Problem(f"train.dpo.{key}", value, why, fix)
    if dpo.reference == "adapters_off":
        if lora is None:
            yield Problem("train.dpo.reference", dpo.reference, "there are no adapters to turn off: model.lora is not set",
                          "set train.dpo.reference: copy (a frozen copy of the initial weights), or add model.lora")  # fmt: skip
        elif not lora.init_lora_weights or lora.peft_config is not None:
            yield Problem("train.dpo.reference", dpo.reference,
                          "the adapters may not start at zero (model.lora.init_lora_weights false, or a model.lora.peft_config), "
                          "so the base model is not the initial policy",
                          "set train.dpo.reference: copy (a frozen copy of the initial adapters)")  # fmt: skip
    if recipe.zero.stage >= 3:
        yield Problem("zero.stage", recipe.zero.stage,
                      "DPO's reference pass swaps each rank's whole weights in place, and ZeRO-3 partitions them",
                      "set zero.stage: 1 or 2")  # fmt: skip
    if recipe.data.packing:
        yield Problem("data.packing", True, "a DPO micro-batch holds whole pairs, one side per row",
                      "remove data.packing")  # fmt: skip
