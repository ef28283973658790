"""The fault campaign's Trainer face (scripts/faults/trainer_face.py) on real dsx3d.Trainer jobs under the deepspeed
launcher: CI runs one seeded trial, its fault kind drawn by the seed (one or two SIGTERMs to the ranks, SIGKILL
of a rank or of the launcher, SIGSTOP of a rank, a full disk, a read-only output directory, or a truncated,
bit-flipped or missing file of the newest checkpoint-N after a SIGTERM stop); the job must end
cleanly, naming the cause, and the script run again with resume_from_checkpoint=True must end with the
uninterrupted run's losses and weights. Three launches, the reference beside the first (about 40 s on 2
cores). DSX3D_TRAINER_FAULTS=N runs every kind N times."""

from __future__ import annotations

import os
import random

import pytest

from scripts.faults import trainer_face
from scripts.faults.inject import can_mount

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("DSX3D_FAULT_SEED", "36"))


def test_the_trainer_face_ends_cleanly_and_resumes_exactly(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    trials = int(os.environ.get("DSX3D_TRAINER_FAULTS", "0") or 0)
    runnable = [k for k in trainer_face.KINDS if can_mount() or k not in trainer_face.MOUNTS]
    if trials:
        kinds = runnable
    else:
        trials, kinds = 1, [random.Random(SEED).choice(runnable)]
    argv = ["--trials", str(trials), "--kinds", ",".join(kinds), "--seed", str(SEED), "--work", str(tmp_path)]
    code = trainer_face.main(argv)
    out = capsys.readouterr().out
    print(out)
    assert f"seed {SEED}" in out
    assert code == 0, out
    for kind in kinds:
        assert f"| {kind} | {trials} | {trials} | {trials} |" in out, out
