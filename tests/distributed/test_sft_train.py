"""`dsx3d train` on chat data (recipes/tiny-sft.yaml, shortened): the masked loss falls, and the held-out
loss in metrics.jsonl (and the tracker, and the plot) equals a single-process HF evaluation of the exported
model on the same held-out rows, under a pipeline (eval_batch) and at pp = 1 (the engine in eval mode)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.data.prepare import prepare_data
from dsx3d.data.stream import counted_tokens
from dsx3d.recipe.schema import Recipe, load_recipe, recipe_from_dict
from dsx3d.run.metrics import read_metrics
from dsx3d.verify.harness import run_ranks

pytestmark = pytest.mark.usefixtures("warm")

ROOT = Path(__file__).resolve().parents[2]


def _recipe(tmp: Path, layout: tuple[int, int, int], steps: int, cache: Path) -> Recipe:
    data = load_recipe(ROOT / "recipes" / "tiny-sft.yaml").model_dump(mode="json")
    dp, tp, pp = layout
    data["parallel"].update(dp=dp, tp=tp, pp=pp)
    data["train"].update(steps=steps, eval_interval=max(1, steps // 2), log_interval=1, warmup_steps=1, report_to=["csv"])
    data["data"]["cache_dir"] = str(cache)
    data["output_dir"] = str(tmp / "run")
    return recipe_from_dict(data)


def _train(rank: int, recipe: Recipe) -> list[float]:
    from dsx3d.train import train

    return train(recipe).losses


def _hf_eval_loss(recipe: Recipe, hf_dir: Path, cache: Path) -> float:
    """Sum of token losses over the evaluated held-out rows / their tokens with loss, on one process."""
    from transformers import AutoModelForCausalLM

    rows = prepare_data(recipe, cache).eval_rows
    assert rows is not None and rows.labels is not None
    assert recipe.train.eval_batches == 0  # every held-out row is evaluated (the last batch padded)
    ids = torch.from_numpy(rows.input_ids.astype("int64"))
    labels = torch.from_numpy(rows.labels.astype("int64"))
    n = int(counted_tokens(rows.labels).sum())
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels, num_items_in_batch=n).loss)


@pytest.mark.parametrize(
    ("layout", "steps"), [((2, 1, 2), 12), ((2, 2, 1), 2)], ids=["dp2-pp2-pipeline", "dp2-tp2-pp1"]
)
def test_sft_trains_and_eval_loss_matches_hf(tmp_path: Path, layout: tuple[int, int, int], steps: int, cache_dir: Any) -> None:
    recipe = _recipe(tmp_path, layout, steps, cache_dir)
    losses = run_ranks(_train, 4, recipe, timeout_s=600)[0]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == sorted({steps // 2, steps})
    if steps >= 10:  # the masked loss falls
        assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
        assert evals[steps] < evals[steps // 2]
    expected = _hf_eval_loss(recipe, tmp_path / "run" / "hf", cache_dir)
    assert evals[steps] == pytest.approx(expected, rel=1e-5)
    with (tmp_path / "run" / "csv" / "run" / "eval_loss.csv").open() as f:
        rows = list(csv.reader(f))[1:]
    assert [int(s) for s, _ in rows] == sorted(evals)
    assert (tmp_path / "run" / "loss.png").is_file()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sft-cache")
