"""Checker rules for `parallel.schedule` (the pipeline schedule): what zero bubble (zb-h1) runs with."""

from __future__ import annotations

from collections.abc import Iterator

from dsx3d.errors import Problem
from dsx3d.integrations.boundary_types import HFConfig
from dsx3d.recipe.schema import Recipe

KEY = "parallel.schedule"


def schedule_problems(recipe: Recipe, hf_config: HFConfig | None) -> Iterator[Problem]:
    if recipe.parallel.schedule != "zb-h1":
        if recipe.parallel.zb_costs == "auto":
            yield Problem(
                "parallel.zb_costs",
                "auto",
                f"auto times the F, B and W passes that zb-h1 runs separately, to order them; "
                f"parallel.schedule {recipe.parallel.schedule} runs DeepSpeed's fused backward, which has no B and "
                "W passes to measure and no order to build",
                "set parallel.schedule: zb-h1, or remove parallel.zb_costs",
            )
        return
    if recipe.parallel.pp == 1:
        yield Problem(
            KEY,
            "zb-h1",
            "a schedule orders the work of pipeline stages; with parallel.pp = 1 there is no pipeline and "
            "zb-h1 changes nothing",
            "set parallel.pp > 1, or leave parallel.schedule at 1f1b",
            severity="warning",
        )
    if recipe.model.lora is not None:
        yield Problem(
            KEY,
            "zb-h1",
            "with model.lora the base weights are frozen, so there are almost no weight gradients to defer "
            "(zero bubble has nothing to fill the idle time with), and the adapters' gradients are summed over "
            "TP by hooks that must run inside the backward pass",
            "set parallel.schedule: 1f1b for LoRA",
        )
    if hf_config is not None:
        from dsx3d.models.moe import experts_per_layer

        if experts_per_layer(hf_config) is not None:
            yield Problem(
                KEY,
                "zb-h1",
                f"{hf_config.model_type} has mixture-of-experts layers: their experts compute weight gradients "
                "inside the backward pass and their token exchange is not ordered for deferred weight passes; "
                "zb-h1 is verified on dense models only",
                "set parallel.schedule: 1f1b for MoE models",
            )
    if recipe.train.activation_checkpointing:
        yield Problem(
            KEY,
            "zb-h1",
            "with train.activation_checkpointing the gradients are right, but every micro-batch between its B and "
            "W pass keeps each deferred linear's recomputed input and output gradient (for a Llama layer over ten "
            "times its checkpoint), which undoes the memory the checkpointing saves and which the memory estimate "
            "does not count",
            "set train.activation_checkpointing: false, or parallel.schedule: 1f1b",
        )
