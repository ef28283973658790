"""bf16 with ZeRO: gradients are reduced over dp in fp32 as well as accumulated in fp32. DeepSpeed's default
for bf16 is bf16 communication (engine.communication_data_type), and ZeRO-2/3 then round every
micro-batch's sum over the DP ranks to 8 bits before it reaches the fp32 accumulator; on a dp2 ZeRO-2 arcee
that moved a bias's SGD update by 1.3e-4 where fp32 reduction left 6e-7."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from deepspeed.runtime.config import get_communication_data_type

from dsx3d.recipe.ds_config import build_ds_config, deep_merge
from dsx3d.recipe.schema import recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]


def _recipe(dtype: str, stage: int):  # type: ignore[no-untyped-def]
    base = yaml.safe_load((ROOT / "recipes" / "tiny-llama-3d.yaml").read_text())
    return recipe_from_dict(deep_merge(base, {"train": {"dtype": dtype}, "zero": {"stage": stage}}))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_with_zero_reduces_in_fp32(stage: int) -> None:
    config = build_ds_config(_recipe("bf16", stage))
    assert get_communication_data_type(config) is torch.float32  # what DeepSpeed reads from it


def test_other_precisions_keep_deepspeeds_default() -> None:
    assert get_communication_data_type(build_ds_config(_recipe("fp32", 2))) is None
    assert get_communication_data_type(build_ds_config(_recipe("bf16", 0))) is None


def test_a_users_override_wins() -> None:
    recipe = _recipe("bf16", 2)
    recipe.deepspeed["communication_data_type"] = "bf16"
    assert get_communication_data_type(build_ds_config(recipe)) is torch.bfloat16
