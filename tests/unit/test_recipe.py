"""The recipe schema: typos and missing keys are errors naming their path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsx3d.errors import UserError
from dsx3d.recipe.schema import dump_recipe, load_recipe, recipe_from_dict

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MINIMAL = {"model": {"config": {"model_type": "llama"}}}


def _keys(err: pytest.ExceptionInfo[UserError]) -> list[str]:
    return [p.key for p in err.value.problems]


def test_unknown_key_names_its_path() -> None:
    """A typo such as `train.lrr` must not silently fall back to the default learning rate."""
    with pytest.raises(UserError) as err:
        recipe_from_dict({**MINIMAL, "train": {"lrr": 1e-3}, "parallel": {"ppp": 2}})
    assert sorted(_keys(err)) == ["parallel.ppp", "train.lrr"]
    assert "unknown key" in str(err.value)


def test_missing_model_is_named() -> None:
    with pytest.raises(UserError) as err:
        recipe_from_dict({"train": {"steps": 1}})
    assert _keys(err) == ["model"]


@pytest.mark.parametrize(
    "model",
    [{}, {"name_or_path": "x", "config": {"model_type": "llama"}}, {"config": {"hidden_size": 8}}],
    ids=["neither", "both", "no-model-type"],
)
def test_model_needs_exactly_one_source_with_a_type(model: dict) -> None:
    with pytest.raises(UserError) as err:
        recipe_from_dict({"model": model})
    assert _keys(err) == ["model"]


def test_bad_value_names_key() -> None:
    with pytest.raises(UserError) as err:
        recipe_from_dict({**MINIMAL, "parallel": {"tp": 0}, "train": {"dtype": "fp8"}})
    assert sorted(_keys(err)) == ["parallel.tp", "train.dtype"]


def test_dp_auto_resolves_against_the_world() -> None:
    r = recipe_from_dict(
        {**MINIMAL, "parallel": {"tp": 2, "pp": 4}, "cluster": {"nodes": 2, "gpus_per_node": 8}}
    )
    assert r.resolved_dp() == 2
    assert r.resolved_dp(world_size=32) == 4
    assert r.resolved_dp(world_size=12) == 0  # does not divide: the checker reports it
    assert r.layout().world_size == 16


def test_load_recipe_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="file not found"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(UserError, match="mapping"):
        load_recipe(scalar)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_round_trip(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe_from_dict(yaml.safe_load(dump_recipe(recipe))) == recipe
