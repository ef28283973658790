"""16-bit master weights (`bf16.bf16_master_weights_and_grads`, `fp16.fp16_master_weights_and_grads`) are
built by DeepSpeed's ZeRO optimizers only with the optimizer offloaded to the CPU and DeepSpeedCPUAdam
(runtime/base_optimizer.py `_configure_master_weights`); the checker refuses them otherwise, naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from dsx3d.checks import check_recipe
from dsx3d.recipe.schema import recipe_from_dict
from tests.helpers.recipes import tiny_recipe_dict


def _errors(**sections: Any) -> list[Any]:
    recipe = recipe_from_dict(tiny_recipe_dict(parallel={"dp": 1, "tp": 1, "pp": 1}, cluster={"nodes": 1, "gpus_per_node": 1}, **sections))
    return [p for p in check_recipe(recipe, data=False) if p.severity == "error"]


@pytest.mark.parametrize(("section", "key"), [("bf16", "bf16_master_weights_and_grads"), ("fp16", "fp16_master_weights_and_grads")])
def test_master_weights_without_cpu_offload_are_refused(section: str, key: str) -> None:
    errors = _errors(deepspeed={section: {key: True}})
    assert [p.key for p in errors] == [f"deepspeed.{section}.{key}"], errors
    assert "offload" in errors[0].fix and "CPU Adam" in errors[0].reason


def test_both_master_weight_dtypes_are_refused_together() -> None:
    errors = _errors(deepspeed={"bf16": {"bf16_master_weights_and_grads": True}, "fp16": {"fp16_master_weights_and_grads": True}})
    assert len(errors) == 1 and "together" in errors[0].reason, errors


def test_offload_with_deepspeed_adam_passes_the_rule() -> None:
    from dsx3d.checks.ds_schema import schema_problems
    from dsx3d.recipe.ds_config import build_ds_config

    recipe = recipe_from_dict(tiny_recipe_dict(parallel={"dp": 1, "tp": 1, "pp": 1}, cluster={"nodes": 1, "gpus_per_node": 1}))
    config = build_ds_config(recipe)
    config["bf16"] = {"enabled": False, "bf16_master_weights_and_grads": True}
    config["zero_optimization"] = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    config["optimizer"]["params"]["torch_adam"] = False
    assert not [p for p in schema_problems(config, 1) if "master_weights" in p.key]
    config["optimizer"]["params"]["torch_adam"] = True  # torch's AdamW: DeepSpeed's assert fires
    assert [p.key for p in schema_problems(config, 1)] == ["deepspeed.bf16.bf16_master_weights_and_grads"]


def test_bf16_optimizer_does_not_read_the_flag() -> None:
    """bf16 with fp32 accumulation at ZeRO-1 without offload builds BF16_Optimizer, which ignores it."""
    assert not _errors(train={"dtype": "bf16"}, zero={"stage": 1}, deepspeed={"bf16": {"bf16_master_weights_and_grads": True}})
