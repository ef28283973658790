"""The generated DeepSpeed configs: golden files, accepted by DeepSpeed's own parser, batch arithmetic over dp."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from deepspeed.runtime import config as ds_runtime_config
from deepspeed.runtime import lr_schedules

from dsx3d.recipe.ds_config import build_ds_config, deep_merge, render_ds_config, write_ds_config
from dsx3d.recipe.schema import Recipe, load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


class _FakeMpu:
    """Just enough of a PipelineParallelGrid for DeepSpeedConfig: it asks only for the DP world size."""

    def __init__(self, dp: int, tp: int, pp: int):
        self.dp, self.tp, self.pp = dp, tp, pp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_model_parallel_world_size(self) -> int:
        return self.tp * self.pp

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp

    def get_slice_parallel_world_size(self) -> int:
        return self.tp


@pytest.fixture
def parse_ds_config(monkeypatch: pytest.MonkeyPatch):
    """DeepSpeedConfig with the dp world of a fake mpu. Without a process group its `dist.get_rank()` raises
    and it falls back to world size 1 before looking at the mpu, so give it a rank (no process group made)."""
    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda group=None: 0)

    def parse(config: dict[str, Any], dp: int, tp: int = 1, pp: int = 1) -> ds_runtime_config.DeepSpeedConfig:
        return ds_runtime_config.DeepSpeedConfig(config, mpu=_FakeMpu(dp, tp, pp))

    return parse


def _tiny(**patch: Any) -> Recipe:
    """The tiny CPU recipe (dp 2 x tp 2 x pp 2 on 1 x 8, micro 2, 4 micro-batches) with `patch` merged in."""
    return recipe_from_dict(
        deep_merge(yaml.safe_load((ROOT / "recipes" / "tiny-llama-3d.yaml").read_text()), patch)
    )


def test_every_recipe_has_a_golden_config_and_back() -> None:
    assert {p.stem for p in RECIPES} == {p.stem for p in (ROOT / "ds_configs").glob("*.json")}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_golden_config_is_up_to_date(path: Path) -> None:
    """Fails when a change to the generator or a recipe was not followed by `dsx3d config`."""
    golden = (ROOT / "ds_configs" / f"{path.stem}.json").read_text()
    assert render_ds_config(build_ds_config(load_recipe(path))) == golden, (
        f"run: dsx3d config {path.relative_to(ROOT)}"
    )


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_deepspeed_accepts_config_with_batch_over_dp(path: Path, parse_ds_config) -> None:
    recipe = load_recipe(path)
    config = json.loads((ROOT / "ds_configs" / f"{path.stem}.json").read_text())
    # DeepSpeed's data axis: dp x cp ranks (context-parallel ranks average gradients like data-parallel ones)
    dp = config["dsx3d"]["dp"] * config["dsx3d"].get("cp", 1)
    tp, pp = config["dsx3d"]["tp"], config["dsx3d"]["pp"]
    parsed = parse_ds_config(config, dp, tp, pp)
    train = recipe.train
    assert parsed.world_size == dp
    assert parsed.train_batch_size == train.micro_batch_size * train.gradient_accumulation_steps * dp
    assert parsed.zero_optimization_stage == recipe.zero.stage
    assert parsed.bfloat16_config.enabled == (train.dtype == "bf16")
    assert "pipeline_parallel" not in config and "tensor_parallel" not in config


def test_world_size_as_batch_divisor_is_what_fails(parse_ds_config) -> None:
    """The crash the generator avoids: DeepSpeed divides train_batch_size by dp, not by the whole world."""
    config = build_ds_config(_tiny())
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        parse_ds_config({**config, "train_batch_size": 2 * 4 * 8}, dp=2)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_generated_config_has_no_scheduler(schedule: str) -> None:
    """The recipe's schedule is HF's, built by the engine builder (tests/unit/test_lr_schedule_hf.py);
    DeepSpeed's schedules repeat the start rate and warm up over at least 2 steps."""
    assert "scheduler" not in build_ds_config(_tiny(train={"lr_schedule": schedule, "min_lr": 3.0e-4}))


@pytest.mark.parametrize("cls", [lr_schedules.WarmupLR, lr_schedules.WarmupCosineLR, lr_schedules.WarmupDecayLR])
def test_a_scheduler_override_is_deepspeeds_with_auto_from_the_recipe(cls: type) -> None:
    """`deepspeed.scheduler` brings DeepSpeed's own schedule; its "auto" parameters come from the recipe."""
    skip = ("optimizer", "last_batch_iteration", "warmup_type")
    auto = {n: "auto" for n in inspect.signature(cls).parameters if n not in skip}  # DeepSpeed's own names
    recipe = _tiny(train={"min_lr": 3.0e-4}, deepspeed={"scheduler": {"type": cls.__name__, "params": auto}})
    sched = build_ds_config(recipe)["scheduler"]
    assert sched["type"] == cls.__name__
    inspect.signature(cls).bind(None, **sched["params"])  # raises TypeError on a wrong parameter name
    assert sched["params"]["warmup_num_steps"] == 5
    if cls is lr_schedules.WarmupCosineLR:
        assert sched["params"]["cos_min_ratio"] == pytest.approx(0.1)
        assert sched["params"]["total_num_steps"] == 200
    else:
        assert sched["params"]["warmup_max_lr"] == 3.0e-3


def test_bf16_accumulates_in_fp32_only_with_zero() -> None:
    """Without ZeRO, DeepSpeed raises NotImplementedError on bf16 weights with fp32 accumulation."""
    assert build_ds_config(_tiny(train={"dtype": "bf16"}))["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in build_ds_config(_tiny(train={"dtype": "bf16"}, zero={"stage": 0}))
    assert "data_types" not in build_ds_config(_tiny())


def test_layout_section_and_world_size() -> None:
    config = build_ds_config(_tiny(parallel={"dp": "auto"}), world_size=16)
    assert config["dsx3d"] == {
        "dp": 4, "tp": 2, "pp": 2, "ep": 1, "cp": 1, "nodes": 2, "gpus_per_node": 8, "world_size": 16, "stage_layers": None,
        "sequence_parallel": True, "seq_len": 64, "activation_checkpointing": False, "dtype": "fp32",
    }  # fmt: skip
    assert config["train_batch_size"] == 2 * 4 * 4


def test_overrides_merge_deeply_and_never_emit_parallel_sections() -> None:
    overrides = {
        "zero_optimization": {"reduce_bucket_size": 500},
        "pipeline": {"pipe_partitioned": True},
        "pipeline_parallel": {"size": 2},
        "tensor_parallel": {"autotp_size": 2},
    }
    config = build_ds_config(_tiny(deepspeed=overrides))
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 500}
    assert config["pipeline"]["pipe_partitioned"] is True and config["pipeline"]["use_reentrant"] is False
    assert "pipeline_parallel" not in config and "tensor_parallel" not in config


def test_deep_merge_leaves_inputs_alone() -> None:
    base, over = {"a": {"b": 1, "c": [1]}}, {"a": {"c": [2]}, "d": 3}
    assert deep_merge(base, over) == {"a": {"b": 1, "c": [2]}, "d": 3}
    assert base == {"a": {"b": 1, "c": [1]}} and over == {"a": {"c": [2]}, "d": 3}


def test_write_is_canonical_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = write_ds_config(_tiny(), tmp_path / "out" / "tiny.json")
    text = target.read_text()
    assert text.endswith("}\n") and text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert [p.name for p in target.parent.iterdir()] == ["tiny.json"]
