"""dsx3d.Trainer's checkpoint-N manifests, without processes: a save ends with every file's size and checksum; a
truncated, bit-flipped or missing file, or a save that never finished, is named; resume_from_checkpoint=True
falls back to the newest complete checkpoint, an explicit damaged path is refused, and with nothing complete
left the error says so (exit 2 through dsx3d.handle_errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsx3d.checkpoint.checksums import read_sums
from dsx3d.checkpoint.training.checkpointer import _SaveLog
from dsx3d.errors import RunFailure, UserError
from dsx3d.integrations.script_errors import handle_errors
from dsx3d.integrations.trainer_checkpoints import (
    checkpoint_dirs,
    checkpoint_problems,
    finish_save,
    newest_complete,
    resume_checkpoint,
    start_save,
)


def _checkpoint(out: Path, step: int) -> Path:
    """checkpoint-<step> as dsx3d.Trainer saves it: the engine's files hashed while written, HF's files read back."""
    ckpt = out / f"checkpoint-{step}"
    record = start_save(ckpt)
    engine_file = ckpt / f"global_step{step}" / "layer_01-model_00-model_states.pt"
    engine_file.parent.mkdir(parents=True)
    record.attempt(engine_file, lambda: torch.save({"w": torch.full((512,), float(step))}, engine_file))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    torch.save({"cpu": torch.zeros(8)}, ckpt / "rng_state_0.pth")
    finish_save(ckpt, record)
    return ckpt


def test_a_save_ends_with_every_file_in_its_manifest(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, 4)
    sums = read_sums(ckpt)
    assert sums is not None and sorted(sums) == [
        "global_step4/layer_01-model_00-model_states.pt",
        "rng_state_0.pth",
        "trainer_state.json",
    ]
    assert checkpoint_problems(ckpt) == []


@pytest.mark.parametrize("fault", ["truncated", "bitflip", "missing", "unfinished"])
def test_a_damaged_checkpoint_is_named_file_and_reason(tmp_path: Path, fault: str) -> None:
    ckpt = _checkpoint(tmp_path, 4)
    victim = ckpt / "global_step4" / "layer_01-model_00-model_states.pt"
    raw = victim.read_bytes()
    if fault == "truncated":
        victim.write_bytes(raw[:100])
    elif fault == "bitflip":
        victim.write_bytes(raw[:-40] + bytes([raw[-40] ^ 1]) + raw[-39:])
    elif fault == "missing":
        victim.unlink()
    else:  # a kill before the manifest: start_save removed the old one, finish_save never ran
        start_save(ckpt)
        victim = ckpt / "dsx3d_checkpoint.json"
    [problem] = checkpoint_problems(ckpt)
    reason = {
        "truncated": "truncated?",
        "bitflip": "corrupt",
        "missing": "missing",
        "unfinished": "did not finish",
    }
    assert problem.startswith(str(victim)) and reason[fault] in problem, problem


def test_resume_true_takes_the_newest_complete_checkpoint_and_names_the_damaged_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (4, 8, 12):
        _checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-12" / "rng_state_0.pth").unlink()
    start_save(tmp_path / "checkpoint-8")  # checkpoint-8 was being saved again when the job died
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-12", "checkpoint-8", "checkpoint-4"]
    with caplog.at_level("WARNING", logger="dsx3d"):
        assert resume_checkpoint(True, str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert "checkpoint checkpoint-12 is damaged" in caplog.text and "rng_state_0.pth: missing" in caplog.text
    assert (
        "checkpoint checkpoint-8 is damaged" in caplog.text
        and "resuming from checkpoint-4 instead" in caplog.text
    )
    assert resume_checkpoint(str(tmp_path / "checkpoint-4"), str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert resume_checkpoint(None, str(tmp_path)) is None and resume_checkpoint(False, str(tmp_path)) is None


def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, 4)
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(UserError) as err:
        resume_checkpoint(str(ckpt), str(tmp_path))
    assert f"{ckpt / 'trainer_state.json'}: 2 bytes" in str(err.value), err.value


def test_with_nothing_complete_left_the_error_names_every_checkpoint_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UserError, match="no checkpoint-N directory"):
        newest_complete(tmp_path)
    for step in (4, 8):
        (_checkpoint(tmp_path, step) / "trainer_state.json").unlink()
    with pytest.raises(SystemExit) as exit_, handle_errors():
        resume_checkpoint(True, str(tmp_path))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        all(f"checkpoint-{s}/trainer_state.json: missing" in err for s in (4, 8)) and "Traceback" not in err
    )


def test_a_failed_write_fails_the_save_without_a_manifest(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-4"
    record: _SaveLog = start_save(ckpt)

    def fail() -> None:
        raise OSError(28, "No space left on device")

    record.attempt(ckpt / "global_step4" / "mp_rank_00_model_states.pt", fail)
    with pytest.raises(RunFailure, match="no space left on device"):
        finish_save(ckpt, record)
    assert not (ckpt / "dsx3d_checkpoint.json").exists()
    with pytest.raises(SystemExit) as exit_, handle_errors():
        finish_save(ckpt, record)
    assert exit_.value.code == 1
