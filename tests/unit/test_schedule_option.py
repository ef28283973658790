"""parallel.schedule in the recipe, the checker, the estimator and the planner."""

from __future__ import annotations

import pytest

from dsx3d.checks import check_recipe
from dsx3d.estimate import schedules
from dsx3d.models.known_families import tiny_config
from dsx3d.recipe.schema import recipe_from_dict


def _recipe(**parallel: object) -> object:
    return recipe_from_dict(
        {"model": {"config": {"model_type": "llama"}}, "parallel": {"dp": 1, "tp": 1, "pp": 2, **parallel},
         "cluster": {"nodes": 1, "gpus_per_node": 2}, "train": {"gradient_accumulation_steps": 4}}
    )


def test_default_is_1f1b_and_a_wrong_value_names_the_key() -> None:
    assert _recipe().parallel.schedule == "1f1b"
    with pytest.raises(Exception, match="schedule"):
        _recipe(schedule="interleaved")


def _schedule_problems(recipe: object, config: object) -> list[object]:
    return [p for p in check_recipe(recipe, world_size=2, hf_config=config, data=False) if p.key == "parallel.schedule"]


def test_checker_refuses_moe_and_lora_with_zb_h1() -> None:
    dense = tiny_config("llama")
    assert not _schedule_problems(_recipe(schedule="zb-h1"), dense)
    moe = _schedule_problems(_recipe(schedule="zb-h1"), tiny_config("mixtral"))
    assert [p.severity for p in moe] == ["error"] and "1f1b" in moe[0].fix
    data = _recipe(schedule="zb-h1").model_dump()
    data["model"]["lora"] = {"r": 4, "target_modules": ["q_proj"]}
    lora = _schedule_problems(recipe_from_dict(data), dense)
    assert any("LoRA" in p.fix for p in lora)


def test_zb_h1_shortens_the_estimated_pipeline() -> None:
    for p, m in ((2, 4), (4, 8), (8, 32)):
        assert schedules.pipeline_units("zb-h1", p, m) < schedules.pipeline_units("1f1b", p, m) == m + p - 1
        assert schedules.schedule_bubble("zb-h1", p, m) < schedules.schedule_bubble("1f1b", p, m)
        assert max(schedules.held_micro_batches("zb-h1", s, p, m) for s in range(p)) == min(p, m)
    assert schedules.pipeline_units("zb-h1", 1, 4) == 4


def test_zb_costs_in_the_recipe_must_be_three_positive_numbers() -> None:
    assert _recipe(schedule="zb-h1", zb_costs=[1, 1.35, 0.6]).parallel.zb_costs == (1.0, 1.35, 0.6)
    with pytest.raises(Exception, match="zb_costs"):
        _recipe(schedule="zb-h1", zb_costs=[1, 0, 0.6])
