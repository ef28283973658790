"""One source of truth between TrainingArguments and the layout, without processes: each value given in one
place is taken by the other, a disagreement is one problem naming both keys, and an HF-style DeepSpeed JSON
with "auto" values turns into a recipe once it names one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsx3d.errors import UserError
from dsx3d.integrations.layout_source import load_layout, recipe_from_ds_config
from dsx3d.integrations.trainer_args import reconcile
from dsx3d.recipe.ds_config import build_ds_config
from tests.helpers.trainer_helpers import HF_AUTO_CONFIG, layout_recipe, training_args, write_ds_config

MODEL = {"config": {"model_type": "llama"}}
HIDDEN = 64


def _recipe_file(path: Path, train: dict[str, Any]) -> Path:
    data = layout_recipe(1, 1, 1)
    data["train"] = train
    path.write_text(yaml.safe_dump(data))
    return path


def _reconciled(source: Any, **args: Any) -> tuple[Any, Any, list[str]]:
    hf_args = training_args(Path("unused"), **args)
    recipe, claims = load_layout(str(source) if isinstance(source, Path) else source, MODEL, HIDDEN)
    recipe, problems = reconcile(hf_args, recipe, claims)
    return hf_args, recipe, [str(p) for p in problems]


def test_a_dsx3d_config_json_turns_back_into_its_recipe(tmp_path: Path) -> None:
    """Regenerating from the recipe the Trainer rebuilt gives the same JSON: the engine runs the config passed."""
    original = json.loads(write_ds_config(tmp_path / "ds.json", 2, 2, 2).read_text())
    recipe = recipe_from_ds_config(original, "ds.json", MODEL)
    assert build_ds_config(recipe, 8) == original
    with pytest.raises(UserError, match='"dsx3d": {"recipe"'):  # the fix names the section that would do
        recipe_from_ds_config({k: v for k, v in original.items() if k != "dsx3d"}, "plain.json", MODEL)


def test_values_given_once_are_taken_by_the_other_side(tmp_path: Path) -> None:
    """A recipe without train.dtype is bf16; TrainingArguments that say nothing now train bf16 too (before,
    `dsx3d check` passed the recipe and Trainer(...) refused it). The recipe's micro-batch and accumulation
    reach TrainingArguments; TrainingArguments' clipping, checkpointing and learning rate reach the recipe."""
    recipe_path = _recipe_file(tmp_path / "r.yaml", {"micro_batch_size": 3, "gradient_accumulation_steps": 4, "seq_len": 16})
    args, recipe, problems = _reconciled(
        recipe_path,
        per_device_train_batch_size=8,  # HF's default: not given
        gradient_accumulation_steps=1,  # HF's default: not given
        max_grad_norm=0.5,
        gradient_checkpointing=True,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
    )
    assert problems == []
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (3, 4)
    assert (args.bf16, args.fp16) == (True, False) and recipe.train.dtype == "bf16"
    assert recipe.train.grad_clip == 0.5 and recipe.train.activation_checkpointing is True
    assert recipe.train.lr == 1e-4 and recipe.train.lr_schedule == "cosine"
    assert args.activation_checkpointing and args.gradient_checkpointing


def test_disagreements_name_both_keys(tmp_path: Path) -> None:
    recipe_path = _recipe_file(
        tmp_path / "r.yaml", {"micro_batch_size": 2, "dtype": "fp32", "lr": 3e-4, "lr_schedule": "linear", "seq_len": 16}
    )
    _, _, problems = _reconciled(recipe_path, per_device_train_batch_size=4, bf16=True, use_cpu=True, learning_rate=1e-3, lr_scheduler_type="cosine")
    text = "\n".join(problems)
    assert len(problems) == 4, text
    assert "TrainingArguments.per_device_train_batch_size = 4: disagrees with r.yaml: train.micro_batch_size = 2" in text
    assert "TrainingArguments.bf16/fp16 = 'bf16': disagrees with r.yaml: train.dtype = 'fp32'" in text
    assert "TrainingArguments.learning_rate = 0.001: disagrees with r.yaml: train.lr = 0.0003" in text
    assert "TrainingArguments.lr_scheduler_type = 'cosine': disagrees with r.yaml: train.lr_schedule = 'linear'" in text
    # gradient_checkpointing against a generated JSON, which states activation checkpointing (off)
    _, _, problems = _reconciled(write_ds_config(tmp_path / "ds.json", 1, 1, 1), gradient_checkpointing=True)
    assert problems == [
        "error: TrainingArguments.gradient_checkpointing = True: disagrees with ds.json: dsx3d.activation_checkpointing = False."
        " Fix: give the value in one place (the other takes it over) or the same value in each"
    ]


def test_an_hf_config_with_auto_values_takes_its_layout_from_the_recipe_it_names(tmp_path: Path) -> None:
    """HF resolves "auto" from TrainingArguments; dsx3d resolves the layout's from the recipe named in a
    "dsx3d" section, the batch size as micro x accumulation x dp (not x the world size, which a pipeline is not)."""
    _recipe_file(tmp_path / "r.yaml", {"micro_batch_size": 2, "gradient_accumulation_steps": 3, "dtype": "fp32", "seq_len": 16})
    config = {**HF_AUTO_CONFIG, "dsx3d": {"recipe": "r.yaml"}}  # relative to the JSON's folder
    path = tmp_path / "ds_config_zero1.json"
    path.write_text(json.dumps(config))
    args, recipe, problems = _reconciled(path, per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-4)
    assert problems == []
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.bf16) == (2, 3, False)
    assert str(args.lr_scheduler_type.value) == "linear"  # WarmupDecayLR: HF's linear warm-up and decay
    ds = build_ds_config(recipe, 1)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (6, 2, 3)
    assert ds["zero_optimization"]["reduce_bucket_size"] == HIDDEN * HIDDEN and ds["zero_optimization"]["overlap_comm"] is True
    assert ds["steps_per_print"] == 2000 and "auto" not in json.dumps(ds)
    # explicit values are claims like any other; "auto" where HF does not resolve it is refused, by key
    bad = {**config, "gradient_accumulation_steps": 5, "zero_optimization": {"stage": 1, "sub_group_size": "auto"}}
    path.write_text(json.dumps(bad))
    with pytest.raises(UserError, match="zero_optimization.sub_group_size"):
        _reconciled(path)
    del bad["zero_optimization"]
    path.write_text(json.dumps(bad))
    _, _, problems = _reconciled(path)
    assert len(problems) == 1 and "ds_config_zero1.json: gradient_accumulation_steps = 5" in problems[0], problems


@pytest.mark.parametrize(
    "given,dp,cp,refused",
    [({"average_tokens_across_devices": False}, 1, 1, False), ({"average_tokens_across_devices": False}, 2, 1, True),
     ({"label_smoothing_factor": 0.1}, 2, 1, False), ({"label_smoothing_factor": 0.1}, 1, 2, True)],
    ids=str,
)  # fmt: skip
def test_arguments_refused_only_where_they_would_not_be_the_same_run(given: dict[str, Any], dp: int, cp: int, refused: bool) -> None:
    """average_tokens_across_devices=False at dp 1 averages over one device (the same run); label smoothing runs on
    the vocab shards, but not on CP slices."""
    from dsx3d.integrations.trainer_args import unsupported_args

    problems = [str(p) for p in unsupported_args(training_args(Path("unused"), **given), dp, cp)]
    key = next(iter(given))
    assert bool(problems) == refused and all(f"TrainingArguments.{key}" in p for p in problems), problems
