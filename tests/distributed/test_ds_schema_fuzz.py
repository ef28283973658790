"""DeepSpeed sections are checked with DeepSpeed's own parsers (dsx3d.checks.ds_schema) before launch: a fuzz over
section values drawn from DeepSpeed's pydantic models (their fields and types; valid and invalid values).
Every config the checker accepts builds a real engine (one forked world-1 rank builds them all); every
refused one names a `deepspeed.` path. CI draws a sample; DSX3D_DS_FUZZ=N draws N configs."""

from __future__ import annotations

import enum
import os
import types
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dsx3d.checks import check_recipe
from dsx3d.recipe.schema import recipe_from_dict
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

COUNT = int(os.environ.get("DSX3D_DS_FUZZ", "20"))

# Fields that switch on hardware paths or other features (offload, quantisation, hierarchical or MiCS
# partitioning, ZenFlow), and the precision switches the recipe's train.dtype owns: not drawn.
NOT_DRAWN = {
    "zero_optimization": {
        "stage", "offload_param", "offload_optimizer", "zenflow", "cpu_offload", "cpu_offload_param",
        "cpu_offload_use_pin_memory", "zero_hpz_partition_size", "zero_quantized_weights",
        "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "mics_shard_size",
        "mics_hierarchical_params_gather", "leaf_module", "legacy_stage1", "compute_grad_norm",
    },
    "bf16": {"enabled"},
    "fp16": {"enabled"},
}
INVALID = st.sampled_from(["not-a-value", [1, 2], {"x": 1}, -1.5])


def _models() -> dict[str, Any]:
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "comms_logger": CommsLoggerConfig,
        "tensorboard": TensorBoardConfig,
        "csv_monitor": CSVConfig,
    }


def _valid(annotation: Any) -> st.SearchStrategy[Any] | None:
    """Values of a field's declared type, small enough for a tiny model."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [_valid(a) for a in typing.get_args(annotation) if a is not type(None)]
        return None if any(o is None for o in options) else st.one_of(st.none(), *options)
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(annotation))
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(1, 1 << 24)
    if annotation is float:
        return st.floats(0.0, 1e4, allow_nan=False)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return st.sampled_from([m.value for m in annotation])
    return None


@st.composite
def _section(draw: st.DrawFn, key: str, model: Any) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(INVALID)  # the whole section not a mapping
    fields = {
        name: (f.alias or name, _valid(f.annotation))
        for name, f in model.model_fields.items()
        if name not in NOT_DRAWN.get(key, ()) and _valid(f.annotation) is not None
    }
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)) if fields else []
    out: dict[str, Any] = {}
    for name in chosen:
        alias, valid = fields[name]
        out[alias] = draw(st.one_of(valid, INVALID) if draw(st.integers(0, 3)) == 0 else valid)
    return out


@st.composite
def _overrides(draw: st.DrawFn) -> dict[str, Any]:
    models = _models()
    keys = draw(st.lists(st.sampled_from(sorted(models)), min_size=1, max_size=3, unique=True))
    return {key: draw(_section(key, models[key])) for key in keys}


def _recipe(overrides: dict[str, Any], tmp: str) -> Any:
    d = tiny_recipe_dict(
        parallel={"dp": 1, "tp": 1, "pp": 1}, cluster={"nodes": 1, "gpus_per_node": 1}, output_dir=f"{tmp}/run"
    )
    d["deepspeed"] = _with_paths(overrides, tmp)
    return recipe_from_dict(d)


def _with_paths(overrides: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Monitors write under the test's folder, not the working directory."""
    out = dict(overrides)
    for key in ("tensorboard", "csv_monitor"):
        if isinstance(out.get(key), dict):
            out[key] = {**out[key], "output_path": f"{tmp}/{key}"}
    return out


def _build_all(rank: int, recipes: list[Any]) -> list[str | None]:
    from dsx3d.engine.builder import build_engine

    failures: list[str | None] = []
    for recipe in recipes:
        try:
            build_engine(recipe)
            failures.append(None)
        except Exception as err:  # reported with its config by the test
            failures.append(f"{type(err).__name__}: {err}"[:500])
    return failures


def test_fp16_not_a_mapping_is_an_error_naming_the_path() -> None:
    recipe = recipe_from_dict(tiny_recipe_dict(deepspeed={"fp16": "yes"}))
    errors = [p for p in check_recipe(recipe, data=False) if p.severity == "error"]
    assert [p.key for p in errors] == ["deepspeed.fp16"], errors
    assert "mapping" in errors[0].reason and errors[0].value == "yes"


def test_accepted_configs_build_engines_refused_ones_name_a_path(tmp_path: Any) -> None:
    from dsx3d.verify.harness import run_ranks

    tmp = str(tmp_path)
    accepted: list[tuple[dict[str, Any], Any]] = []
    refused: list[dict[str, Any]] = []

    @settings(max_examples=COUNT, deadline=None, derandomize=True, phases=[Phase.generate], suppress_health_check=list(HealthCheck), database=None)
    @given(_overrides())
    def check(overrides: dict[str, Any]) -> None:
        recipe = _recipe(overrides, tmp)
        errors = [p for p in check_recipe(recipe, data=False) if p.severity == "error"]
        if errors:
            refused.append(overrides)
            assert all(p.key.startswith("deepspeed.") for p in errors), (overrides, errors)
        elif overrides not in [o for o, _ in accepted]:
            accepted.append((overrides, recipe))

    check()
    failures = run_ranks(_build_all, 1, [r for _, r in accepted], timeout_s=600)[0]
    broken = [(o, f) for (o, _), f in zip(accepted, failures, strict=True) if f is not None]
    assert not broken, broken
    assert accepted and refused, (len(accepted), len(refused))  # the sample covers both sides
