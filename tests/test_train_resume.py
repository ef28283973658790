"""Checkpoints and resume of `dsx3d.train.train` on forked gloo ranks (dp 2 x tp 2 x pp 2, ZeRO-1, fp32).

A run stopped after N steps and resumed for N more must train exactly like an uninterrupted 2N-step run
(optimizer and ZeRO partitions, LR schedule, data position, RNG). A job killed in the middle of a
checkpoint save must resume from the previous complete checkpoint, never from the partial one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from dsx3d.checkpoint.training_format import LATEST, RECIPE_FILE, read_latest, tag_for
from dsx3d.recipe import Recipe, recipe_from_dict
from dsx3d.run.metrics import read_metrics
from dsx3d.testing.harness import RankFailure, run_ranks
from dsx3d.testing.recipes import tiny_recipe_dict

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

WORLD = 8
STEPS = 6
SAVE_INTERVAL = 2


def make_recipe(output_dir: Path, cache_dir: Path) -> Recipe:
    return recipe_from_dict(
        tiny_recipe_dict(
            parallel={"dp": 2, "tp": 2, "pp": 2},
            cluster={"nodes": 1, "gpus_per_node": WORLD},
            train={
                "micro_batch_size": 1,
                "steps": STEPS,
                "warmup_steps": 2,
                "lr_schedule": "cosine",
                "weight_decay": 0.01,
                "save_interval": SAVE_INTERVAL,
                "keep_checkpoints": 2,
            },
            data={"cache_dir": str(cache_dir)},
            output_dir=str(output_dir),
        )
    )


def _train(rank: int, recipe: Recipe, kwargs: dict[str, Any]) -> Any:
    from dsx3d.train import train

    return train(recipe, **kwargs)


def run(recipe: Recipe, **kwargs: Any) -> Any:
    """Rank 0's TrainResult."""
    return run_ranks(_train, WORLD, recipe, kwargs, timeout_s=300)[0]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dsx3d-cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[list[float], Path]:
    out = tmp_path_factory.mktemp("reference")
    old_umask = os.umask(0o077)  # a private umask: the run must still leave files colleagues can read
    try:
        result = run(make_recipe(out / "run", cache_dir))
    finally:
        os.umask(old_umask)
    out = out / "run"
    assert (result.start_step, result.end_step, len(result.losses)) == (0, STEPS, STEPS)
    return result.losses, out


def test_uninterrupted_run_leaves_its_files(reference: tuple[list[float], Path]) -> None:
    losses, out = reference
    assert read_latest(out / "checkpoints") == tag_for(STEPS)
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert tags == [tag_for(4), tag_for(6)]  # keep_checkpoints = 2
    tag_dir = out / "checkpoints" / tag_for(STEPS)
    assert (tag_dir / RECIPE_FILE).is_file() and len(list((tag_dir / "rng").iterdir())) == WORLD
    records = read_metrics(out / "metrics.jsonl")
    assert [r["loss"] for r in records] == losses
    for name in ("recipe.yaml", "ds_config.json", "placement.json", "loss.png", "tokenizer/tokenizer.json"):
        assert (out / name).is_file(), name


def test_run_files_are_readable_by_others(reference: tuple[list[float], Path]) -> None:
    """Written under umask 077, every file of the run is 0644 and every directory 0755 (on a shared cluster
    colleagues read the checkpoints and the exported model)."""
    _, out = reference
    paths = [out, *out.rglob("*")]
    assert any(p.suffix == ".safetensors" for p in paths) and any(p.suffix == ".pt" for p in paths)
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        executable = path.suffix == ".py"  # DeepSpeed's zero_to_fp32.py beside the tags
        assert mode == (0o755 if path.is_dir() or executable else 0o644), (path, oct(mode))


def test_training_checkpoints_convert_to_universal(reference: tuple[list[float], Path], tmp_path: Path) -> None:
    """Tags written by `dsx3d train` carry universal_checkpoint_info, so they can be resharded with their
    optimizer state (dsx3d export --universal)."""
    from dsx3d.checkpoint.universal import to_universal

    _, out = reference
    universal = to_universal(out / "checkpoints" / tag_for(STEPS), tmp_path / "uni" / tag_for(STEPS))
    assert any(universal.rglob("*.pt"))


def test_resume_trains_exactly_like_an_uninterrupted_run(
    reference: tuple[list[float], Path], tmp_path: Path, cache_dir: Path
) -> None:
    losses, ref_out = reference
    recipe = make_recipe(tmp_path, cache_dir)
    first = run(recipe, stop_at=STEPS // 2)
    second = run(recipe, resume=True)
    assert (first.end_step, second.start_step, second.end_step) == (STEPS // 2, STEPS // 2, STEPS)
    assert first.losses + second.losses == pytest.approx(losses, abs=1e-6, rel=0)
    # the LR schedule continued where it was, and metrics.jsonl carries the whole run
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    reference_records = read_metrics(ref_out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in resumed] == pytest.approx([r["lr"] for r in reference_records], rel=1e-9)
    assert [r["grad_norm"] for r in resumed] == pytest.approx(
        [r["grad_norm"] for r in reference_records], abs=1e-5
    )


def test_kill_during_a_save_resumes_from_the_previous_checkpoint(
    reference: tuple[list[float], Path], tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 3 dies after writing its first file of checkpoint step 4; its peers have written theirs or are
    writing them. `latest` must still name step 2, and the resumed run must match the reference."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original = TorchCheckpointEngine.save

    def dying_save(self: Any, state_dict: Any, path: str) -> Any:
        result = original(self, state_dict, path)
        if os.environ.get("RANK") == "3" and f"/{tag_for(4)}/" in str(path):
            os._exit(9)
        return result

    monkeypatch.setattr(TorchCheckpointEngine, "save", dying_save)
    recipe = make_recipe(tmp_path, cache_dir)
    with pytest.raises(RankFailure):
        run(recipe)
    monkeypatch.undo()
    ckpt = tmp_path / "checkpoints"
    assert read_latest(ckpt) == tag_for(2)
    assert any((ckpt / tag_for(4)).glob("*.pt"))  # the partial save is there, but not named by `latest`

    resumed = run(recipe, resume=True)
    losses, _ = reference
    assert resumed.start_step == 2
    assert resumed.losses == pytest.approx(losses[2:], abs=1e-6, rel=0)
    assert (ckpt / LATEST).read_text() == tag_for(STEPS)
