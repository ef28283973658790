"""The examples the docs show (docs/guide/trainer.md), run: the two-line switch of a run_clm-style script against the same script on
plain transformers, accelerate's own loop (works at tp 1 x pp 1, refused at prepare otherwise), and a loop
written on dsx3d's engine. Forked gloo ranks (dsx3d.verify.harness), a tiny local checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsx3d.errors import UserError
from dsx3d.recipe.ds_config import build_ds_config
from dsx3d.recipe.schema import recipe_from_dict
from dsx3d.verify.harness import run_ranks

pytestmark = pytest.mark.usefixtures("warm")

EXAMPLES = Path(__file__).resolve().parents[2] / "scripts" / "examples"
SEQ = 32


def example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return example("run_clm").make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def write_recipe(path: Path, model: Path, dp: int, tp: int, pp: int, **extra: Any) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(model)},
                "parallel": {"dp": dp, "tp": tp, "pp": pp},
                "cluster": {"nodes": 1, "gpus_per_node": dp * tp * pp},
                "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "seq_len": SEQ, "dtype": "fp32"},
                "zero": {"stage": 1},
                **extra,
            }
        )
    )
    return path


def _run_clm(rank: int, argv: list[str], plain: bool) -> dict[str, Any]:
    module = example("run_clm")
    if plain:  # the script before the switch
        import transformers

        module.Trainer = transformers.Trainer
    return module.main(argv)


def test_run_clm_two_line_switch_matches_plain_transformers(tmp_path: Path, tiny: Path) -> None:
    """The script with `from dsx3d import Trainer` and `--deepspeed recipe.yaml` (dp 2 x pp 2, batch sizes from
    the recipe) logs the losses, eval loss and accuracy of the same script on plain transformers."""
    common = ["--model_name_or_path", str(tiny), "--max_steps", "3", "--do_train", "--do_eval", "--logging_steps", "1",
              "--report_to", "none", "--disable_tqdm", "true", "--max_train_samples", "48", "--max_eval_samples", "8",
              "--block_size", str(SEQ), "--save_strategy", "no"]  # fmt: skip
    recipe = write_recipe(tmp_path / "r.yaml", tiny, 2, 1, 2)
    ours = run_ranks(_run_clm, 4, [*common, "--output_dir", str(tmp_path / "ours"), "--deepspeed", str(recipe)], False)[0]
    ref_args = ["--output_dir", str(tmp_path / "ref"), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]
    ref = run_ranks(_run_clm, 1, [*common, *ref_args], True)[0]
    losses = [[h["loss"] for h in r["log_history"] if "loss" in h] for r in (ours, ref)]
    assert len(losses[0]) == len(losses[1]) == 3 and max(abs(a - b) for a, b in zip(*losses, strict=True)) <= 1e-5, losses
    for key in ("eval_loss", "eval_accuracy"):
        assert abs(ours["metrics"][key] - ref["metrics"][key]) <= 1e-5, (key, ours["metrics"], ref["metrics"])
    assert (tmp_path / "ours" / "config.json").is_file()  # trainer.save_model() without a directory: output_dir


def _engine_loop(rank: int, recipe: Path) -> list[float]:
    return example("engine_loop").main([str(recipe)])


def test_engine_loop_trains_the_same_at_any_layout(tmp_path: Path, tiny: Path) -> None:
    """The loop on dsx3d's engine at pp 2 gives the losses of the same loop on one process."""
    data = {"data": {"tokenizer": str(tiny), "cache_dir": str(tmp_path / "cache")}}
    pipe = write_recipe(tmp_path / "pp2.yaml", tiny, 1, 1, 2, **data)
    one = write_recipe(tmp_path / "pp1.yaml", tiny, 1, 1, 1, **data)
    for path in (pipe, one):
        recipe = yaml.safe_load(path.read_text())
        recipe["train"].update(steps=3, lr=2e-3)
        path.write_text(yaml.safe_dump(recipe))
    a, b = run_ranks(_engine_loop, 2, pipe)[0], run_ranks(_engine_loop, 1, one)[0]
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5, (a, b)


def _accelerate_loop(rank: int, ds_config: Path, model: Path) -> Any:
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(ds_config))
    try:
        return example("accelerate_loop").main(["--model", str(model), "--steps", "2", "--seq-len", str(SEQ)])
    except UserError as err:
        return str(err)


def test_accelerate_loop_runs_at_tp1_pp1_and_is_refused_at_prepare_otherwise(tmp_path: Path, tiny: Path) -> None:
    def ds_json(name: str, pp: int) -> Path:
        recipe = recipe_from_dict(yaml.safe_load(write_recipe(tmp_path / f"{name}.yaml", tiny, 1, 1, pp).read_text()))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(build_ds_config(recipe, pp)))
        return path

    losses = run_ranks(_accelerate_loop, 1, ds_json("flat", 1), tiny)[0]
    assert isinstance(losses, list) and len(losses) == 4 and all(x == x for x in losses), losses  # 2 steps x 2 micro
    refused = run_ranks(_accelerate_loop, 1, ds_json("pipe", 2), tiny)[0]
    assert isinstance(refused, str) and "Accelerator.prepare" in refused and "dsx3d.Trainer" in refused, refused
