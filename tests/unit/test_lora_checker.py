"""model.lora in recipes: the checker names the key, the value and the fix for every LoRA setup dsx3d cannot
train (before any process starts), `dsx3d check` exits 2 without a traceback, and a saved peft LoraConfig
(model.lora.peft_config) is read by peft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dsx3d.checks import check_recipe
from dsx3d.errors import UserError
from dsx3d.recipe.ds_config import deep_merge
from dsx3d.recipe.schema import recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]
LORA_RECIPE: dict[str, Any] = yaml.safe_load((ROOT / "recipes" / "tiny-lora.yaml").read_text())


def _problems(patch: dict[str, Any]) -> list[str]:
    return [str(p) for p in check_recipe(recipe_from_dict(deep_merge(LORA_RECIPE, patch)), data=False)]


def test_the_shipped_lora_recipe_passes() -> None:
    assert _problems({}) == []


def test_unknown_target_module_is_named_with_the_choices() -> None:
    [problem] = _problems({"model": {"lora": {"target_modules": ["q_proj", "qkv_proj"]}}})
    assert "model.lora.target_modules = 'qkv_proj'" in problem and "names no module" in problem
    assert "'o_proj'" in problem and "'q_proj'" in problem  # the fix lists what exists


def test_a_target_that_is_not_a_linear_is_refused() -> None:
    [problem] = _problems({"model": {"lora": {"target_modules": ["input_layernorm"]}}})
    assert "'input_layernorm'" in problem and "is not a linear layer" in problem


def test_zero3_and_empty_stages_are_refused() -> None:
    problems = "\n".join(_problems({"zero": {"stage": 3}, "parallel": {"pp": 1, "dp": 2}}))
    assert "zero.stage = 3: LoRA is trained with ZeRO stages 0-2" in problems
    problems = "\n".join(_problems({"parallel": {"stage_layers": [4, 0]}}))
    assert "parallel.stage_layers = [4, 0]" in problems and "set parallel.stage_layers: [2, 2]" in problems


def test_unknown_lora_key_names_its_path() -> None:
    with pytest.raises(UserError) as err:
        recipe_from_dict(deep_merge(LORA_RECIPE, {"model": {"lora": {"rank": 8}}}))
    assert "model.lora.rank" in str(err.value) and "unknown key" in str(err.value)


def test_cli_check_exits_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dsx3d.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(deep_merge(LORA_RECIPE, {"model": {"lora": {"target_modules": ["qkv"]}}})))
    code = main(["check", str(bad)])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2 and "model.lora.target_modules = 'qkv'" in text and "Traceback" not in text


def test_saved_peft_config_is_read_and_checked(tmp_path: Path) -> None:
    from peft import LoraConfig

    from dsx3d.engine.builder import lora_spec

    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]).save_pretrained(str(tmp_path / "good"))
    recipe = recipe_from_dict(deep_merge(LORA_RECIPE, {"model": {"lora": {"peft_config": str(tmp_path / "good")}}}))
    assert [str(p) for p in check_recipe(recipe, data=False)] == []
    spec = lora_spec(recipe)
    assert spec is not None and spec.config.r == 4 and set(spec.config.target_modules) == {"q_proj", "v_proj"}

    LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, modules_to_save=["lm_head"]).save_pretrained(str(tmp_path / "bad"))
    problems = "\n".join(_problems({"model": {"lora": {"peft_config": str(tmp_path / "bad")}}}))
    assert "model.lora.peft_config.use_dora = True" in problems and "model.lora.peft_config.modules_to_save" in problems
    problems = "\n".join(_problems({"model": {"lora": {"peft_config": str(tmp_path / "missing")}}}))
    assert "model.lora.peft_config" in problems and "adapter_config.json" in problems
