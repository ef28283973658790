"""Checkpoints and resume of `dsx3d.train.train` on forked gloo ranks (dp 2 x tp 2 x pp 2, ZeRO-1, fp32).

A run stopped after N steps and resumed for N more must train exactly like an uninterrupted 2N-step run
(optimizer and ZeRO partitions, LR schedule, data position, RNG). A job killed in the middle of a
checkpoint save must resume from the previous complete checkpoint, never from the partial one.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from dsx3d.checkpoint.training.disk_format import LATEST, RECIPE_FILE, read_latest, tag_for
from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.run.metrics import read_metrics
from dsx3d.verify.harness import RankFailure, run_ranks
from tests.helpers.payload import write_pickle_payload
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

WORLD = 8
STEPS = 6
SAVE_INTERVAL = 2


def make_recipe(output_dir: Path, cache_dir: Path, async_save: bool = False) -> Recipe:
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
                "async_save": async_save,
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
    from dsx3d.checkpoint.training.universal import to_universal

    _, out = reference
    universal = to_universal(out / "checkpoints" / tag_for(STEPS), tmp_path / "uni" / tag_for(STEPS))
    assert any(universal.rglob("*.pt"))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_trains_exactly_like_an_uninterrupted_run(
    reference: tuple[list[float], Path], tmp_path: Path, cache_dir: Path, async_save: bool
) -> None:
    """Also with train.async_save, resuming from step 2's checkpoint, which a background thread wrote while
    step 3 trained: step 3's tag is removed and `latest` set back, as a kill during step 3's save leaves
    them (the reference saves synchronously)."""
    losses, ref_out = reference
    recipe = make_recipe(tmp_path, cache_dir, async_save)
    first = run(recipe, stop_at=STEPS // 2)
    start = STEPS // 2
    if async_save:
        from dsx3d.checkpoint.training.tags import remove_tag

        start = SAVE_INTERVAL
        remove_tag(tmp_path / "checkpoints", tag_for(STEPS // 2))
        (tmp_path / "checkpoints" / LATEST).write_text(tag_for(start))
    second = run(recipe, resume=True)
    assert (first.end_step, second.start_step, second.end_step) == (STEPS // 2, start, STEPS)
    assert first.losses[:start] + second.losses == pytest.approx(losses, abs=1e-6, rel=0)
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
    writing them. `latest` must still name step 2, and the resumed run must match the reference. (The files
    are written by the checkpointer's hashing writer, which stands in for DeepSpeed's TorchCheckpointEngine.save:
    the kill follows the write there.)"""
    from dsx3d.checkpoint.training import checkpointer

    original = checkpointer.save_hashed

    def dying_save(save: Any, path: Path) -> Any:
        result = original(save, path)
        if os.environ.get("RANK") == "3" and f"/{tag_for(4)}/" in str(path):
            os._exit(9)
        return result

    monkeypatch.setattr(checkpointer, "save_hashed", dying_save)
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


# --- damaged checkpoints, a full disk, another layout ------------------------------------------------------


def _copy_run(reference: tuple[list[float], Path], tmp_path: Path, cache_dir: Path, **train: Any) -> Recipe:
    """The reference run's directory, copied, with its recipe pointing there (train values patched)."""
    import shutil

    _, ref_out = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    data = make_recipe(out, cache_dir).model_dump()
    data["train"].update(train)
    return recipe_from_dict(data)


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    reference: tuple[list[float], Path], tmp_path: Path, cache_dir: Path
) -> None:
    """A truncated file in the tag `latest` names: the resume names it and continues from the previous
    complete tag, training exactly like the uninterrupted run from there."""
    recipe = _copy_run(reference, tmp_path, cache_dir, steps=STEPS + 2)
    ckpt = tmp_path / "run" / "checkpoints"
    victim = ckpt / tag_for(STEPS) / "layer_01-model_01-model_states.pt"
    victim.write_bytes(victim.read_bytes()[:-500])
    longer = run(recipe, resume=True)
    assert longer.start_step == STEPS - SAVE_INTERVAL
    losses, _ = reference
    assert longer.losses[:SAVE_INTERVAL] == pytest.approx(losses[STEPS - SAVE_INTERVAL :], abs=1e-6, rel=0)
    assert read_latest(ckpt) == tag_for(STEPS + 2)


PAYLOAD_TARGETS = {
    # pp = 1: DeepSpeed's regular engine, the module and client state in one file, ZeRO-1 optimizer state
    1: ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
    # pp = 2: the pipeline engine also reads one file per pipeline item and TP rank
    2: ["mp_rank_00_model_states.pt", "layer_01-model_00-model_states.pt"],
}


def _load_payloads(rank: int, recipe: Recipe, marker: str) -> list[str]:
    """Every rank: save a real checkpoint; then, for each file DeepSpeed's load_checkpoint reads, a copy of
    the tag with that file made a pickle payload (by rank 0), loaded through dsx3d's weights-only wrapper;
    last, the first one loaded by DeepSpeed alone (the control)."""
    import shutil

    from dsx3d.checkpoint.safe_load import UnsafeCheckpoint, weights_only_loads
    from dsx3d.checkpoint.training.checkpointer import Checkpointer
    from dsx3d.distributed import comm
    from dsx3d.engine.builder import build_engine

    engine = build_engine(recipe)
    ckpt = Path(recipe.output_dir) / "checkpoints"
    Checkpointer(engine, ckpt, recipe, 2).save(1, {"step": 1})
    targets = PAYLOAD_TARGETS[recipe.parallel.pp]
    if rank == 0:
        for i, target in enumerate(targets):
            shutil.copytree(ckpt / tag_for(1), ckpt / f"payload-{i}")
            write_pickle_payload(ckpt / f"payload-{i}" / target, Path(marker))
    comm.barrier()
    said = []
    for i in range(len(targets)):
        try:
            with weights_only_loads():
                engine.ds_engine.load_checkpoint(str(ckpt), tag=f"payload-{i}")
            said.append("loaded")
        except UnsafeCheckpoint as err:
            said.append(str(err))
    with contextlib.suppress(Exception):  # the payload runs, then DeepSpeed chokes on what it returned
        engine.ds_engine.load_checkpoint(str(ckpt), tag="payload-0")
    return said


@pytest.mark.parametrize("pp", [1, 2], ids=["regular-engine", "pipeline"])
def test_deepspeeds_own_loads_never_run_a_pickle_payload(tmp_path: Path, cache_dir: Path, pp: int) -> None:
    """Every file DeepSpeed's load_checkpoint reads, made a pickle payload: through dsx3d each load is
    refused naming the file, and the marker appears only when DeepSpeed loads one on its own. Both engines:
    pp = 1 runs DeepSpeed's regular engine, pp = 2 its pipeline engine (stage 0 reads the targets)."""
    data = make_recipe(tmp_path / "run", cache_dir).model_dump()
    data["parallel"], data["cluster"]["gpus_per_node"] = {"dp": 1, "tp": 1, "pp": pp}, pp
    marker = tmp_path / "marker"
    said = run_ranks(_load_payloads, pp, recipe_from_dict(data), str(marker), timeout_s=180)[0]
    for target, message in zip(PAYLOAD_TARGETS[pp], said, strict=True):
        assert "weights_only" in message and target in message, (target, message)
    assert marker.exists()  # the control ran the payload: the refusals above are not vacuous


def test_the_universal_converter_never_runs_a_pickle_payload(
    reference: tuple[list[float], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ds_to_universal unpickles every optimizer file with weights_only=False; inside dsx3d it cannot run
    code even when the up-front file check is bypassed."""
    import shutil

    import dsx3d.checkpoint.training.universal as universal
    from dsx3d.checkpoint.safe_load import UnsafeCheckpoint

    _, ref_out = reference
    tag_dir = tmp_path / tag_for(STEPS)
    shutil.copytree(ref_out / "checkpoints" / tag_for(STEPS), tag_dir)
    victim = next(tag_dir.glob("zero_pp_rank_1_*optim_states.pt"))
    write_pickle_payload(victim, tmp_path / "marker")
    with pytest.raises(UserError, match=f"{victim.name}: .*truncated"):  # the manifest knows the file
        universal.to_universal(tag_dir, tmp_path / "uni")
    # a forger who also rewrites the manifest still meets the weights-only check, and below that the load
    from dsx3d.checkpoint.checksums import digest, read_sums, write_sums

    write_sums(tag_dir, {**(read_sums(tag_dir) or {}), victim.name: digest(victim)})
    with pytest.raises(UserError, match="weights-only load refuses"):
        universal.to_universal(tag_dir, tmp_path / "uni")
    monkeypatch.setattr(universal, "file_problem", lambda path: None)
    monkeypatch.setattr("dsx3d.checkpoint.training.tags.file_problem", lambda path: None)
    with pytest.raises(UnsafeCheckpoint):
        universal.to_universal(tag_dir, tmp_path / "uni")
    assert not (tmp_path / "marker").exists() and not (tmp_path / "uni").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".uni")] == []


def _no_leftovers(root: Path) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if ".tmp" in p.name or p.name.startswith((".deleting", ".dsx3d-space-probe"))
    ]


def _check_disk_full_outcome(err: RankFailure, run_dir: Path, words: str) -> None:
    ckpt = run_dir / "checkpoints"
    assert words in err.root_error and "the previous checkpoint step-000002 is kept" in err.root_error
    assert read_latest(ckpt) == tag_for(2)
    assert not (ckpt / tag_for(4)).exists()
    assert _no_leftovers(run_dir) == []
    from dsx3d.checkpoint.training.checkpointer import tag_problems

    assert tag_problems(ckpt / tag_for(2)) == []


def _mount_tmpfs(mount: Path, size: int) -> bool:
    import subprocess

    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    return done.returncode == 0


def test_a_full_disk_says_so_keeps_the_previous_checkpoint_and_leaves_no_temporary_files(
    reference: tuple[list[float], Path], tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run directory on a tmpfs with room for the run's files and one checkpoint, not two: the save of
    step 4 fails half-way. Where no tmpfs can be mounted (not root), rank 3 runs out of space by
    injection instead, half-way through a file of step 4. Either way: said as such, `latest` stays on step
    2, which is complete, and no partial or temporary file is left."""
    import errno
    import subprocess

    _, ref_out = reference
    tag_bytes = sum(p.stat().st_size for p in (ref_out / "checkpoints" / tag_for(STEPS)).rglob("*") if p.is_file())
    mount = tmp_path / "fs"
    if _mount_tmpfs(mount, int(tag_bytes * 1.4) + 400_000):
        try:
            with pytest.raises(RankFailure) as info:
                run(make_recipe(mount / "run", cache_dir))
            _check_disk_full_outcome(info.value, mount / "run", "no space left on device")
        finally:
            subprocess.run(["umount", str(mount)], check=False)
        return
    from dsx3d.checkpoint.training import checkpointer

    original = checkpointer.save_hashed  # the checkpointer's writer of every file DeepSpeed saves

    def full_disk(save: Any, path: Path) -> Any:
        if os.environ.get("RANK") == "3" and f"/{tag_for(4)}/" in str(path):
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return original(save, path)

    monkeypatch.setattr(checkpointer, "save_hashed", full_disk)
    with pytest.raises(RankFailure) as info:
        run(make_recipe(tmp_path / "run", cache_dir))
    _check_disk_full_outcome(info.value, tmp_path / "run", "rank 3: no space left on device")


def _resume_at(recipe: Recipe, dp: int, tp: int, pp: int, grad_accum: int) -> Recipe:
    data = recipe.model_dump()
    data["parallel"] = {"dp": dp, "tp": tp, "pp": pp}
    data["cluster"]["gpus_per_node"] = dp * tp * pp
    data["train"]["gradient_accumulation_steps"] = grad_accum
    return recipe_from_dict(data)


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[list[float], Path]:
    """A run stopped after step 3 at dp 2 x tp 2 x pp 2 (its losses, its directory)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    first = run(make_recipe(out, cache_dir), stop_at=3)
    return first.losses, out


@pytest.mark.parametrize(("dp", "tp", "pp", "grad_accum"), [(2, 1, 2, 2), (1, 2, 2, 4)], ids=["tp2-to-1", "dp2-to-1"])
def test_resume_at_another_layout_reshards_and_trains_like_the_uninterrupted_run(
    reference: tuple[list[float], Path],
    stopped_at_3: tuple[list[float], Path],
    tmp_path: Path,
    cache_dir: Path,
    dp: int,
    tp: int,
    pp: int,
    grad_accum: int,
) -> None:
    """Stopped at step 3 at dp 2 x tp 2 x pp 2, resumed with plain --resume at another layout (the same
    global batch): the tag is converted to a universal checkpoint automatically, and every later loss
    equals the uninterrupted run's (weights, Adam moments, schedule and data position all carried over)."""
    import shutil

    losses, _ = reference
    first_losses, stopped = stopped_at_3
    shutil.copytree(stopped, tmp_path / "run")
    moved = _resume_at(make_recipe(tmp_path / "run", cache_dir), dp, tp, pp, grad_accum)
    second = run_ranks(_train, dp * tp * pp, moved, {"resume": True}, timeout_s=300)[0]
    assert (second.start_step, second.end_step) == (3, STEPS)
    assert first_losses + second.losses == pytest.approx(losses, abs=1e-5, rel=0)
    worst = max(abs(a - b) for a, b in zip(second.losses, losses[3:], strict=True))
    print(f"resumed at dp {dp} x tp {tp} x pp {pp}: worst loss difference {worst:.3g} over steps 4-{STEPS}")
    ckpt = tmp_path / "run" / "checkpoints"
    assert read_latest(ckpt) == tag_for(STEPS)
    # the resumed run saved steps 4 and 6 at its own layout; step 3 and its universal copy were pruned whole
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [tag_for(4), tag_for(6)]
    assert _no_leftovers(tmp_path / "run") == []


def test_resume_that_cannot_be_exact_is_refused_before_any_process_starts(
    stopped_at_3: tuple[list[float], Path], tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dsx3d train --resume` with another seq_len (which would also move the cost-balanced split): exit 2
    with the reason, before the launcher runs; at another layout it says it will reshard."""
    import shutil

    import yaml

    from dsx3d.cli import main

    _, stopped = stopped_at_3
    shutil.copytree(stopped, tmp_path / "run")
    data = make_recipe(tmp_path / "run", cache_dir).model_dump(mode="json")
    data["train"]["seq_len"] = 16
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    assert main(["train", str(tmp_path / "r.yaml"), "--resume", "--dry-run"]) == 2
    assert "train.seq_len" in capsys.readouterr().err
    data["train"]["seq_len"], data["parallel"]["tp"], data["cluster"]["gpus_per_node"] = 32, 1, 4
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    assert main(["train", str(tmp_path / "r.yaml"), "--resume", "--dry-run"]) == 0
    assert "resharding: step-000003 was written at dp 2 x tp 2 x pp 2" in capsys.readouterr().err
