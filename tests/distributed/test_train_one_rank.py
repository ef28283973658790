"""`python -m dsx3d.train RECIPE` without a launcher (no RANK, WORLD_SIZE, MASTER_ADDR in the environment)
trains as one rank, and `train.report_to` sends every logged step to the tracking backends (csv here: the
tensorboard and wandb packages are optional, and the checker refuses them when they are missing)."""

from __future__ import annotations

import csv
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsx3d.checks import check_recipe
from dsx3d.recipe.schema import recipe_from_dict
from dsx3d.run.metrics import read_metrics
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = pytest.mark.usefixtures("warm")

STEPS = 3
LR = 3e-3
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _recipe(tmp: Path, report_to: Any) -> dict[str, Any]:
    return tiny_recipe_dict(
        parallel={"dp": 1, "tp": 1, "pp": 1},
        cluster={"gpus_per_node": 1},
        train={
            "steps": STEPS,
            "gradient_accumulation_steps": 1,
            "report_to": report_to,
            "lr": LR,
            "lr_schedule": "cosine",
        },
        data={"cache_dir": str(tmp / "cache")},
        output_dir=str(tmp / "run"),
    )


def _hf_lrs() -> list[float]:
    import torch
    from transformers import get_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler, out = get_scheduler("cosine", opt, num_warmup_steps=1, num_training_steps=STEPS), []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def _main_without_launcher(recipe: str) -> None:
    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)
    from dsx3d.train import main

    main([recipe])  # exits the process with its code


def test_one_rank_without_launcher_variables_trains_and_reports_to_csv(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, "csv")))
    child = mp.get_context("fork").Process(target=_main_without_launcher, args=(str(recipe),))
    child.start()
    child.join(300)
    assert child.exitcode == 0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # the rate each step used is HF's cosine schedule (one warm-up step): 0, the peak, then the decay
    assert [r["lr"] for r in records] == pytest.approx(_hf_lrs(), abs=1e-12)
    csv_dir = tmp_path / "run" / "csv" / "run"
    for figure in ("loss", "lr", "grad_norm", "tokens_per_s"):
        with (csv_dir / f"train_{figure}.csv").open() as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", figure]
        assert [int(s) for s, _ in rows[1:]] == [r["step"] for r in records]
        assert [float(v) for _, v in rows[1:]] == pytest.approx([r[figure] for r in records]), figure
    assert (tmp_path / "run" / "hf" / "config.json").is_file()


def test_report_to_values_and_missing_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A backend whose package is missing is a checker error naming train.report_to (DeepSpeed would fail
    minutes later, on rank 0 only); "none" and a single name are accepted as HF's report_to accepts them."""
    import importlib.util

    assert recipe_from_dict(_recipe(tmp_path, "none")).train.report_to == []
    assert recipe_from_dict(_recipe(tmp_path, ["csv", "tensorboard"])).train.report_to == ["csv", "tensorboard"]
    with pytest.raises(Exception, match="report_to"):
        recipe_from_dict(_recipe(tmp_path, "mlflow"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else find_spec(name, *a))
    recipe = recipe_from_dict(_recipe(tmp_path, ["csv", "tensorboard", "wandb"]))
    problems = [p for p in check_recipe(recipe) if p.key == "train.report_to"]
    assert sorted(p.value for p in problems) == ["tensorboard", "wandb"], problems
    assert all(p.severity == "error" and "pip install" in p.fix for p in problems)


def _tensorboard_events(rank: int, out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dsx3d.run.tracking import Tracker

    tracker = Tracker(["tensorboard"], out, "job", enabled=True)
    for step in (1, 2):
        tracker.log({"step": step, "loss": 5.0 - step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0 * step})
    tracker.close()
    events = EventAccumulator(str(out / "tensorboard" / "job"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_backend_writes_every_figure_at_its_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from dsx3d.verify.harness import run_ranks

    events = run_ranks(_tensorboard_events, 1, tmp_path)[0]
    assert events["train/loss"] == [(1, 4.0), (2, 3.0)]
    assert events["train/tokens_per_s"] == [(1, 100.0), (2, 200.0)]
    assert set(events) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"}
