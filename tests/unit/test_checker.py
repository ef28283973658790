"""The checker: one bad recipe per rule, each problem naming its key; the shipped recipes pass.

The base is the tiny CPU recipe (1 node x 8, dp 2 x tp 2 x pp 2, fp32, ZeRO-1, 4 micro-batches), which is clean.
Each case patches it so exactly one rule fires and says which failure the rule prevents.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import AutoConfig

from dsx3d.checks import DATA_RULES, RULES, check_recipe, raise_for_errors
from dsx3d.errors import Problem, UserError
from dsx3d.recipe.ds_config import deep_merge
from dsx3d.recipe.schema import load_recipe, recipe_from_dict

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
BASE: dict[str, Any] = yaml.safe_load((RECIPES / "tiny-llama-3d.yaml").read_text())


def _check(patch: dict[str, Any], world_size: int | None = None) -> list[Problem]:
    return check_recipe(recipe_from_dict(deep_merge(copy.deepcopy(BASE), patch)), world_size=world_size)


def _model(**dims: Any) -> dict[str, Any]:
    return {"model": {"config": dims}}


# (patch, world size, key, severity, words in the message); the id says what would otherwise go wrong.
CASES = [
    pytest.param(
        {"model": {"config": {"vocab_size": 1024}}},
        None,
        "model.config.vocab_size",
        "error",
        "can have up to 2048 tokens",
        id="trained-tokenizer-larger-than-the-vocabulary",
    ),
    pytest.param(
        {"parallel": {"dp": 3}},
        None,
        "parallel.dp x parallel.tp x parallel.pp",
        "error",
        "world size 8",
        id="world-mismatch-hangs-at-rendezvous",
    ),
    pytest.param(
        {},
        12,
        "parallel.dp x parallel.tp x parallel.pp",
        "error",
        "--world-size 12",
        id="world-size-option-mismatch",
    ),
    pytest.param(
        {"parallel": {"dp": 4, "pp": 1}, "zero": {"stage": 0}, "train": {"dtype": "bf16"}},
        None,
        "zero.stage",
        "error",
        "counts the TP shards of rank 0 only",
        id="bf16-without-zero-under-tp-clips-by-a-wrong-norm",
    ),
    pytest.param(
        {"parallel": {"dp": "auto", "pp": 3}, "train": {"gradient_accumulation_steps": 6}},
        None,
        "parallel.dp",
        "error",
        "does not divide",
        id="dp-auto-does-not-divide",
    ),
    pytest.param(
        {"zero": {"stage": 2}},
        None,
        "zero.stage",
        "error",
        "reduce-scatter",
        id="zero2-with-pp-asserts-after-process-groups",
    ),
    pytest.param(
        {
            "parallel": {"dp": 3, "tp": 4, "pp": 2},
            "cluster": {"nodes": 4, "gpus_per_node": 6},
            **_model(
                model_type="llama",
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=4,
                num_hidden_layers=4,
                intermediate_size=128,
                vocab_size=2048,
            ),
        },
        None,
        "parallel.tp",
        "error",
        "cross a node",
        id="tp-group-over-the-network",
    ),
    pytest.param(
        _model(hidden_size=48, num_attention_heads=3, num_key_value_heads=1),
        None,
        "parallel.tp",
        "error",
        "num_attention_heads = 3",
        id="heads-not-divisible",
    ),
    pytest.param(
        _model(num_key_value_heads=1),
        None,
        "parallel.tp",
        "error",
        "num_key_value_heads = 1",
        id="kv-heads-not-divisible",
    ),
    pytest.param(
        _model(intermediate_size=129),
        None,
        "parallel.tp",
        "error",
        "intermediate_size = 129",
        id="mlp-not-divisible",
    ),
    pytest.param(
        _model(vocab_size=2049),
        None,
        "parallel.tp",
        "warning",
        "pads the vocabulary to 2050",
        id="vocab-padded",
    ),
    pytest.param(
        _model(num_hidden_layers=1),
        None,
        "parallel.pp",
        "error",
        "1 decoder layer(s)",
        id="more-stages-than-layers",
    ),
    pytest.param(
        {"parallel": {"stage_layers": [4]}},
        None,
        "parallel.stage_layers",
        "error",
        "1 entries",
        id="stage-layers-length",
    ),
    pytest.param(
        {"parallel": {"stage_layers": [1, 2]}},
        None,
        "parallel.stage_layers",
        "error",
        "sums to 3",
        id="stage-layers-sum",
    ),
    pytest.param(
        {"parallel": {"dp": 1, "pp": 3, "stage_layers": [2, 0, 2]}, "cluster": {"gpus_per_node": 6}},
        None,
        "parallel.stage_layers",
        "error",
        "stage(s) [1] would hold no layer and no parameter",
        id="stage-layers-empty-middle-stage",
    ),
    pytest.param(
        {"parallel": {"pipeline_layout": "Et*2|t|tL"}},
        None,
        "parallel.pipeline_layout",
        "error",
        "3 stages but parallel.pp = 2",
        id="pipeline-layout-stages",
    ),
    pytest.param(
        {"parallel": {"pipeline_layout": "Et*2|t*3L"}},
        None,
        "parallel.pipeline_layout",
        "error",
        "sums to 5",
        id="pipeline-layout-sum",
    ),
    pytest.param(
        {"train": {"gradient_accumulation_steps": 1}},
        None,
        "train.gradient_accumulation_steps",
        "warning",
        "idles 50%",
        id="fewer-micro-batches-than-stages",
    ),
    pytest.param(
        {"deepspeed": {"train_batch_size": 64}},
        None,
        "deepspeed.train_batch_size",
        "error",
        "dp = 2, not the world size 8",
        id="batch-size-over-world-fails-at-init",
    ),
    pytest.param(
        {"deepspeed": {"zero_optimization": {"sub_group_size": "auto"}}},
        None,
        "deepspeed.zero_optimization.sub_group_size",
        "error",
        "resolves \"auto\" only where",
        id="auto-left-unresolved",
    ),
    pytest.param(
        {"deepspeed": {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}}},
        None,
        "deepspeed.scheduler",
        "warning",
        "HF's get_scheduler",
        id="deepspeed-scheduler-replaces-the-hf-schedule",
    ),
    pytest.param(
        {"deepspeed": {"wall_clock_breakdown": True}},
        None,
        "deepspeed.wall_clock_breakdown",
        "error",
        "timer has already been started",
        id="wall-clock-breakdown-with-pipeline",
    ),
    pytest.param(
        {"deepspeed": {"comet": {"enabled": True}}},
        None,
        "deepspeed.comet.enabled",
        "error",
        "comet_ml package",
        id="monitor-package-missing",
    ),
    pytest.param(
        {"data": {"source": "/no/such/corpus.jsonl"}},
        None,
        "data.source",
        "error",
        "not found",
        id="data-source-missing",
    ),
    pytest.param(
        {"model": {"config": {"pad_token_id": 4000}}},
        None,
        "model.config.pad_token_id",
        "error",
        "cannot build the model",
        id="config-transformers-cannot-build",
    ),
    pytest.param(
        {"deepspeed": {"gradient_accumulation_steps": 8}},
        None,
        "deepspeed.gradient_accumulation_steps",
        "error",
        "train.gradient_accumulation_steps = 4",
        id="grad-accum-override",
    ),
    pytest.param(
        {"train": {"dtype": "bf16"}, "deepspeed": {"data_types": {"grad_accum_dtype": "bf16"}}},
        None,
        "deepspeed.data_types.grad_accum_dtype",
        "error",
        "fp32",
        id="bf16-accumulation-in-pipeline",
    ),
    pytest.param(
        {"train": {"dtype": "bf16"}, "zero": {"stage": 0}},
        None,
        "zero.stage",
        "warning",
        "bf16",
        id="bf16-pipeline-without-zero",
    ),
    pytest.param(
        {"deepspeed": {"pipeline_parallel": {"size": 2}}},
        None,
        "deepspeed.pipeline_parallel",
        "error",
        "silently ignores",
        id="pipeline-section-ignored",
    ),
    pytest.param(
        {"deepspeed": {"tensor_parallel": {"autotp_size": 2}}},
        None,
        "deepspeed.tensor_parallel",
        "error",
        "AutoTP",
        id="autotp-shards-twice",
    ),
    pytest.param(
        {"deepspeed": {"zero_optimization": {"stage": 0}}},
        None,
        "deepspeed.zero_optimization.stage",
        "error",
        "zero.stage = 1",
        id="zero-override",
    ),
    pytest.param(
        {"deepspeed": {"bf16": {"enabled": True}}},
        None,
        "deepspeed.bf16.enabled",
        "error",
        "train.dtype = fp32",
        id="precision-override",
    ),
    pytest.param(
        {"train": {"dtype": "fp16"}}, None, "train.dtype", "warning", "not supported", id="fp16-on-cpu"
    ),
    pytest.param(
        {"deepspeed": {"fp16": "yes"}},
        None,
        "deepspeed.fp16",
        "error",
        "expects a mapping",
        id="deepspeed-section-every-rank-would-die-parsing",
    ),
    pytest.param(
        {"parallel": {"schedule": "zb-h1"}, "train": {"activation_checkpointing": True}},
        None,
        "parallel.schedule",
        "error",
        "activation_checkpointing",
        id="zero-bubble-holds-unmeasured-activations",
    ),
    pytest.param(
        {"parallel": {"dp": 4, "pp": 1}, "zero": {"stage": 3}, "train": {"loss_tile_tokens": 32}},
        None,
        "train.loss_tile_tokens",
        "error",
        "ZeRO-3 has already partitioned",
        id="tiled-loss-gradient-of-a-partitioned-head",
    ),
    pytest.param(
        {"train": {"loss_tile_tokens": 128}},
        None,
        "train.loss_tile_tokens",
        "warning",
        "saves no memory",
        id="one-tile-holds-the-whole-micro-batch",
    ),
    pytest.param(
        {"parallel": {"zb_costs": "auto"}},
        None,
        "parallel.zb_costs",
        "error",
        "schedule: zb-h1",
        id="measured-costs-need-split-passes",
    ),
    pytest.param(
        {"train": {"async_save": True}, "deepspeed": {"checkpoint": {"writer": {"type": "python"}}}},
        None,
        "deepspeed.checkpoint.writer",
        "error",
        "would never run",
        id="async-save-would-silently-bypass-deepspeeds-writer",
    ),
    pytest.param(
        _model(model_type="no-such-model"),
        None,
        "model.config.model_type",
        "error",
        "no model",
        id="unknown-model-type",
    ),
]


@pytest.mark.parametrize(("patch", "world_size", "key", "severity", "words"), CASES)
def test_each_rule(patch: dict, world_size: int | None, key: str, severity: str, words: str) -> None:
    problems = _check(patch, world_size)
    hits = [p for p in problems if p.key == key and p.severity == severity and words in str(p)]
    assert hits, "\n".join(map(str, problems)) or "no problems"
    assert all(p.fix for p in hits) and key in str(hits[0])


def test_base_recipe_is_clean() -> None:
    assert _check({}) == []


def test_hf_style_auto_values_resolve_from_the_recipe() -> None:
    """The "auto" values of HF's example DeepSpeed JSONs are accepted and take the recipe's values."""
    from dsx3d.recipe.ds_config import auto_paths, build_ds_config

    auto = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"},
    }
    recipe = recipe_from_dict(deep_merge(copy.deepcopy(BASE), {"deepspeed": auto}))
    # no error; the one warning: DeepSpeed's schedule replaces the recipe's (HF's)
    assert [(p.key, p.severity) for p in check_recipe(recipe)] == [("deepspeed.scheduler", "warning")]
    config = build_ds_config(recipe, hidden_size=64)
    assert auto_paths(config) == []
    plain = build_ds_config(recipe_from_dict(copy.deepcopy(BASE)))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == plain[key]
    assert config["optimizer"] == plain["optimizer"] and config["bf16"] == plain["bf16"]
    assert config["scheduler"] == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": recipe.train.lr, "warmup_num_steps": recipe.train.warmup_steps},
    }  # DeepSpeed's schedule, its own parameters only
    assert config["zero_optimization"] == {"stage": recipe.zero.stage, "reduce_bucket_size": 64 * 64}


def test_every_rule_has_a_case() -> None:
    assert len(CASES) >= len(RULES) + len(DATA_RULES)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_3_with_pipeline_is_refused_with_the_fix(stage: int) -> None:
    """DeepSpeed only asserts this in the pipeline engine, after every process group exists."""
    (problem,) = [p for p in _check({"zero": {"stage": stage}}) if p.key == "zero.stage"]
    assert problem.severity == "error" and "reduce-scatter" in problem.reason
    assert "zero.stage: 1" in problem.fix and "parallel.pp: 1" in problem.fix


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_zero_stage_without_pipeline_is_accepted(stage: int, dtype: str, tp: int) -> None:
    """pp = 1 runs DeepSpeed's regular engine (dsx3d.models.sequential), which takes ZeRO-0/1/2/3 with TP and
    with CPU offload (tests/distributed/test_pp1_engine.py); only bf16 without ZeRO under TP is refused (a wrong norm)."""
    recipe = {"zero": {"stage": stage}, "parallel": {"pp": 1, "tp": tp, "dp": 8 // tp}, "train": {"dtype": dtype}}
    offload = {"offload_optimizer": {"device": "cpu"}} if stage else {}
    recipe["deepspeed"] = {"zero_optimization": offload} if offload else {}
    refused = stage == 0 and dtype == "bf16" and tp > 1
    assert [p.key for p in _check(recipe)] == (["zero.stage"] if refused else [])


def test_every_problem_is_reported_at_once() -> None:
    problems = _check(
        {"zero": {"stage": 3}, "parallel": {"stage_layers": [4]}, "deepspeed": {"pipeline_parallel": {}}}
    )
    assert {"zero.stage", "parallel.stage_layers", "deepspeed.pipeline_parallel"} <= {p.key for p in problems}


def test_missing_checkpoint_directory_is_a_problem(tmp_path: Path) -> None:
    recipe = recipe_from_dict({**BASE, "model": {"name_or_path": str(tmp_path / "nowhere")}})
    assert [p.key for p in check_recipe(recipe)] == ["model.name_or_path"]


def test_checkpoint_directory_config_is_read(tmp_path: Path) -> None:
    AutoConfig.for_model(**{**BASE["model"]["config"], "num_key_value_heads": 1}).save_pretrained(tmp_path)
    recipe = recipe_from_dict({**BASE, "model": {"name_or_path": str(tmp_path)}})
    assert [p.reason for p in check_recipe(recipe)][0].startswith("the model's num_key_value_heads = 1")


def test_hf_config_argument_skips_loading() -> None:
    recipe = recipe_from_dict({**BASE, "model": {"name_or_path": "/nowhere"}})
    hf = AutoConfig.for_model(**BASE["model"]["config"])
    assert check_recipe(recipe, hf_config=hf) == []


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_pass(path: Path) -> None:
    assert [str(p) for p in check_recipe(load_recipe(path))] == []


def test_raise_for_errors(caplog: pytest.LogCaptureFixture) -> None:
    warning = Problem("train.dtype", "fp16", "r", "f", severity="warning")
    error = Problem("zero.stage", 3, "r", "f")
    with caplog.at_level(logging.WARNING, logger="dsx3d"):
        raise_for_errors([warning])
    assert "train.dtype" in caplog.text
    with pytest.raises(UserError) as err:
        raise_for_errors([warning, error])
    assert err.value.problems == [error]
