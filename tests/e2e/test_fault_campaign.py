"""The fault campaign (scripts/faults/campaign.py) on real `dsx3d train` jobs. CI runs one seeded trial of
each kind that no other CI test injects, chained (each launch resumes the previous fault and is the next
one's target): the job must end within the bound with no process left, a message naming the cause and no
traceback, and every resume must train the uninterrupted run's losses, and the finished run export its
weights. The other kinds have their own CI tests at a fixed moment (COVERED_ELSEWHERE names them). Kinds that
need mounts (a full disk, a read-only directory) run where the tests run as root, as CI does. About 8 launches (about 3
minutes on 2 cores). DSX3D_FAULTS=N runs every kind N times (20 for the issue's table)."""

from __future__ import annotations

import os

import pytest

from scripts.faults import campaign
from scripts.faults.inject import KINDS, NEEDS_MOUNTS, can_mount

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("DSX3D_FAULT_SEED", "36"))

# Kinds whose path another CI test already drives, at a fixed moment (the heartbeat watch's hang: in ranks
# run by the test itself).
COVERED_ELSEWHERE = {
    "sigkill-owner": "tests/e2e/test_train_launch.py::test_every_process_of_the_job_ends_with_dsx3d_train",
    "sigkill-rank": "tests/e2e/test_train_launch.py::test_killed_rank_stops_the_whole_job_and_is_named",
    "sigstop-rank": "tests/distributed/test_faults.py::test_a_stopped_rank_is_named_as_hung_and_the_job_ends",
    "truncated": "tests/e2e/test_train_resume.py::test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one",
}


def test_every_fault_ends_cleanly_and_resumes_exactly(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    trials = int(os.environ.get("DSX3D_FAULTS") or 0)
    kinds = [k for k in KINDS if (can_mount() or k not in NEEDS_MOUNTS) and (trials or k not in COVERED_ELSEWHERE)]
    trials = trials or 1
    code = campaign.main(["--trials", str(trials), "--kinds", ",".join(kinds), "--seed", str(SEED), "--work", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert f"seed {SEED}" in out
    assert code == 0, out
    for kind in kinds:
        assert f"| {kind} | {trials} | {trials} | {trials} |" in out, out
