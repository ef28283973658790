"""The TrainingArguments dsx3d.Trainer reads, over their HF domain: each value either trains equal to plain
single-process transformers.Trainer (every step's learning rate and loss, every evaluation) or is refused at
Trainer(...) with a UserError naming the argument. Values come from transformers' own enums (OptimizerNames,
SchedulerType, IntervalStrategy, SaveStrategy) and from the edges of HF's numeric domains, including values the
recipe's own fields do not take (warm-up ratios, weight decay above 1, a negative norm for no clipping).

CI runs every OptimizerName and a sample of combinations that shows each value of each dimension at least once;
DSX3D_TRAINER_SWEEP=N adds N random combinations (seed DSX3D_TRAINER_SWEEP_SEED)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import SEQ, step_values
from tests.helpers.trainer_space import needs_eval, run_sets, scheduler_kwargs, scheduler_names

pytestmark = pytest.mark.usefixtures("warm")

TOL = 1e-5
CI_COMBINATIONS = 6


def _layout(path: Path) -> Path:
    """dp 1 x tp 1 x pp 2, naming nothing TrainingArguments names but the dtype: every shared value is HF's."""
    recipe = {"model": {"config": {"model_type": "llama"}}, "parallel": {"dp": 1, "tp": 1, "pp": 2},
              "cluster": {"nodes": 1, "gpus_per_node": 2}, "train": {"seq_len": SEQ, "dtype": "fp32"}}  # fmt: skip
    path.write_text(yaml.safe_dump(recipe))
    return path


def _dimensions() -> dict[str, list[Any]]:
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    return {
        "lr_scheduler_type": scheduler_names(),
        "eval_strategy": [s.value for s in IntervalStrategy],
        "save_strategy": [s.value for s in SaveStrategy],
        "gradient_accumulation_steps": [1, 2, 3],
        "length": [{"max_steps": 3}, {"max_steps": -1, "num_train_epochs": 0.25}, {"max_steps": 4, "num_train_epochs": 0.1}],
        "warmup_steps": [0, 1, 2, 2.5, 0.25, 0.5],  # below 1: a ratio of the training steps
        "weight_decay": [0.0, 0.1, 1.5],
        "betas": [(0.9, 0.999), (0.8, 0.95), (0.0, 0.5)],
        "adam_epsilon": [1e-8, 1e-6, 1e-3],
        # HF clips only at a positive norm; None passes TrainingArguments but plain Trainer 5.23 fails on it in
        # training (`max_grad_norm > 0`), so it has no reference here
        "max_grad_norm": [1.0, 0.5, 0.0, -1.0],
        "learning_rate": [2e-3, 1e-4],
        "seed": [0, 7],
    }


def _arguments(choice: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments overrides for one combination, completed as HF itself requires."""
    args = {k: v for k, v in choice.items() if k not in ("length", "betas")}
    args |= choice["length"]
    args["adam_beta1"], args["adam_beta2"] = choice["betas"]
    name = choice["lr_scheduler_type"]
    if needs_eval(name) and args["eval_strategy"] == "no":  # HF's TrainingArguments refuses the pair
        args["eval_strategy"] = "steps"
    if args["eval_strategy"] == "steps":
        args["eval_steps"] = 2
    if args["save_strategy"] == "steps":
        args["save_steps"] = 2
    if args["save_strategy"] == "best":  # HF's Trainer requires the metric
        args["metric_for_best_model"] = "loss"
    args["lr_scheduler_kwargs"] = scheduler_kwargs(name, 3)
    return args


def combinations(count: int, seed: int | None = None) -> list[dict[str, Any]]:
    """`count` combinations: without a seed, each dimension's values in a shuffled cycle (each value shows up
    within the first len(values) combinations); with one, independent random draws."""
    dims = _dimensions()
    rng = random.Random(seed)
    orders = {k: random.Random(k).sample(v, len(v)) for k, v in dims.items()}
    out = []
    for i in range(count):
        choice = {k: rng.choice(v) if seed is not None else orders[k][i % len(v)] for k, v in dims.items()}
        out.append(_arguments(choice))
    return out


def _assert_trains_like_hf(sets: list[dict[str, Any]], ours: list[Any], ref: list[Any]) -> None:
    for overrides, mine, theirs in zip(sets, ours, ref, strict=True):
        assert not isinstance(mine, str), (overrides, mine)
        for key, tol in (("learning_rate", 1e-9), ("loss", TOL), ("eval_loss", TOL)):
            a, b = step_values(mine, key), step_values(theirs, key)
            assert len(a) == len(b) and (a or key == "eval_loss"), (overrides, key, a, b)
            assert all(abs(x - y) <= tol for x, y in zip(a, b, strict=True)), (overrides, key, a, b)


def _run(tmp_path: Path, sets: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    ours = run_ranks(run_sets, 2, tmp_path / "ours", sets, _layout(tmp_path / "r.yaml"))[0]
    trained = [s for s, r in zip(sets, ours, strict=True) if not isinstance(r, str)]
    ref = run_ranks(run_sets, 1, tmp_path / "ref", trained, None)[0] if trained else []
    it = iter(ref)
    return ours, [next(it) if not isinstance(r, str) else r for r in ours]


def test_each_optimizer_name_trains_like_hf_or_is_refused_naming_optim(tmp_path: Path) -> None:
    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames]
    sets = [{"optim": name, "max_steps": 3, "warmup_steps": 1} for name in names]
    ours, ref = _run(tmp_path, sets)
    trained = [n for n, r in zip(names, ours, strict=True) if not isinstance(r, str)]
    assert "adamw_torch" in trained, ours
    _assert_trains_like_hf([s for s in sets if s["optim"] in trained], [r for r in ours if not isinstance(r, str)],
                           [r for r, o in zip(ref, ours, strict=True) if not isinstance(o, str)])  # fmt: skip
    for name, result in zip(names, ours, strict=True):
        if isinstance(result, str):
            assert f"TrainingArguments.optim = {name!r}: not supported by dsx3d.Trainer" in result, result
            assert "Fix: use one of ['adamw_torch'" in result, result


def test_training_arguments_sample_trains_like_hf(tmp_path: Path) -> None:
    sets = combinations(CI_COMBINATIONS)
    extra = int(os.environ.get("DSX3D_TRAINER_SWEEP", "0"))
    if extra:
        sets += combinations(extra, seed=int(os.environ.get("DSX3D_TRAINER_SWEEP_SEED", "0")))
    ours, ref = _run(tmp_path, sets)
    _assert_trains_like_hf(sets, ours, ref)


@pytest.mark.parametrize(
    "given",
    [{"warmup_steps": 0.5}, {"warmup_steps": 2.5}, {"weight_decay": 1.5}, {"max_grad_norm": None}, {"max_grad_norm": -1.0},
     {"adam_beta1": 0.0}, *({"lr_scheduler_type": name} for name in scheduler_names())],
    ids=str,
)  # fmt: skip
def test_values_outside_the_recipes_fields_reconcile(tmp_path: Path, given: dict[str, Any]) -> None:
    """Without processes: HF values the recipe cannot hold are agreed on and stay in TrainingArguments (the
    engine's optimizer and HF's scheduler read them there); no clipping reaches the layout as 0."""
    from dsx3d.integrations.layout_source import load_layout
    from dsx3d.integrations.trainer_args import reconcile
    from tests.helpers.trainer_helpers import training_args

    steps_metric = needs_eval(str(given.get("lr_scheduler_type", "linear")))  # HF's TrainingArguments requires it
    args = training_args(tmp_path / "out", **given, **({"eval_strategy": "steps"} if steps_metric else {}))
    recipe, claims = load_layout(str(_layout(tmp_path / "r.yaml")), {"config": {"model_type": "llama"}}, 64)
    recipe, problems = reconcile(args, recipe, claims)
    assert problems == []
    for key, value in given.items():
        if key == "max_grad_norm":
            assert args.max_grad_norm == recipe.train.grad_clip == 0.0
        else:
            assert str(getattr(getattr(args, key), "value", getattr(args, key))) == str(value)
