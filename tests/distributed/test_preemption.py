"""Preemption on forked gloo ranks (dp 1 x tp 2 x pp 2, fp32): a SIGTERM to one rank at a seeded random step
makes every rank finish that step, save it, and stop; the resumed run loses no step and trains exactly like
the uninterrupted run. A second signal stops at once and leaves the last complete checkpoint intact."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from dsx3d.checkpoint.training.disk_format import read_latest, tag_for
from dsx3d.checkpoint.training.tags import tag_problems
from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.verify.harness import RankFailure, run_ranks
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

WORLD = 4
STEPS = 6
SEED = int(os.environ.get("DSX3D_FAULT_SEED", "36"))


def make_recipe(out: Path, cache_dir: Path) -> Recipe:
    return recipe_from_dict(
        tiny_recipe_dict(
            train={"steps": STEPS, "save_interval": 4, "keep_checkpoints": 2},
            data={"cache_dir": str(cache_dir)},
            output_dir=str(out),
        )
    )


def _train(rank: int, recipe: Recipe, signals: dict[int, list[tuple[int, int]]], kwargs: dict[str, Any]) -> Any:
    """Train with a StopRequest installed; `signals` maps a rank to (step, signal) pairs it sends itself
    at the start of that step (while the step runs, as a cluster's notice would arrive)."""
    from dsx3d.engine import Engine3D
    from dsx3d.run.preempt import StopRequest
    from dsx3d.train import train

    mine = signals.get(rank, [])
    calls = [0]
    original = Engine3D.train_step

    def train_step(self: Engine3D, batches: Any) -> float:
        calls[0] += 1
        step = calls[0]
        for at, signum in mine:
            if at == step:
                os.kill(os.getpid(), signum)
        return original(self, batches)

    Engine3D.train_step = train_step  # type: ignore[method-assign]  # a forked child: gone with it
    stop = StopRequest(0, Path(recipe.output_dir) / "checkpoints", loud=rank == 0).install()
    return train(recipe, resume=kwargs.get("resume", False), stop=stop)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dsx3d-cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> list[float]:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = run_ranks(_train, WORLD, make_recipe(out, cache_dir), {}, {}, timeout_s=300)[0]
    assert result.stopped_by is None and result.end_step == STEPS
    return list(result.losses)


def test_sigterm_to_one_rank_saves_that_step_everywhere_and_resumes_exactly(
    reference: list[float], tmp_path: Path, cache_dir: Path
) -> None:
    rng = random.Random(SEED)
    step, rank = rng.randint(1, STEPS - 1), rng.randrange(WORLD)
    print(f"seed {SEED}: SIGTERM to rank {rank} during step {step}")
    recipe = make_recipe(tmp_path / "run", cache_dir)
    results = run_ranks(_train, WORLD, recipe, {rank: [(step, signal.SIGTERM)]}, {}, timeout_s=300)
    assert {(r.stopped_by, r.end_step) for r in results} == {(signal.SIGTERM, step)}  # every rank agreed
    ckpt = tmp_path / "run" / "checkpoints"
    assert read_latest(ckpt) == tag_for(step) and tag_problems(ckpt / tag_for(step)) == []
    assert not (tmp_path / "run" / "hf").exists()  # stopped: no export of an unfinished model
    resumed = run_ranks(_train, WORLD, recipe, {}, {"resume": True}, timeout_s=300)[0]
    assert (resumed.start_step, resumed.end_step) == (step, STEPS)
    assert results[0].losses + resumed.losses == pytest.approx(reference, abs=1e-6, rel=0)  # no step lost


def test_a_second_signal_stops_at_once_and_keeps_the_last_complete_checkpoint(
    reference: list[float], tmp_path: Path, cache_dir: Path
) -> None:
    """Rank 0 gets SIGUSR1 and then SIGTERM during step 5 (before its checkpoint exists): rank 0 stops at
    once with code 128 + 15, `latest` still names step 4, which is complete, and the resume trains like the
    uninterrupted run."""
    recipe = make_recipe(tmp_path / "run", cache_dir)
    with pytest.raises(RankFailure) as err:
        run_ranks(_train, WORLD, recipe, {0: [(5, signal.SIGUSR1), (5, signal.SIGTERM)]}, {}, timeout_s=300)
    assert "exit codes: [143," in str(err.value)
    ckpt = tmp_path / "run" / "checkpoints"
    assert read_latest(ckpt) == tag_for(4) and tag_problems(ckpt / tag_for(4)) == []
    resumed = run_ranks(_train, WORLD, recipe, {}, {"resume": True}, timeout_s=300)[0]
    assert resumed.start_step == 4
    assert resumed.losses == pytest.approx(reference[4:], abs=1e-6, rel=0)
