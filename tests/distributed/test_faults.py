"""A hung rank, found by heartbeat and named, on forked gloo ranks (seconds, no launcher)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from dsx3d.verify.harness import RankFailure, run_ranks

pytestmark = pytest.mark.usefixtures("warm")

HANG_TIMEOUT_S = 2.0


def _stop_rank_2(rank: int, logs: str) -> None:
    """Every rank all-reduces in a loop; rank 2 stops itself (SIGSTOP: alive, not dead) at iteration 3."""
    from dsx3d.distributed import comm
    from dsx3d.run.lifeline import heartbeat
    from dsx3d.run.ranks import RankInfo, gather_rank_infos, job_dir, naming_dead_peers

    handler = logging.FileHandler(f"{logs}/rank-{rank}.log")
    logging.getLogger("dsx3d").addHandler(handler)
    info = RankInfo.from_env(rank, comm.get_world_size())
    peers = gather_rank_infos(info)
    with naming_dead_peers(info, peers), heartbeat(job_dir(peers), info, peers, HANG_TIMEOUT_S):
        for i in range(10_000):
            comm.all_reduce_sum(torch.ones(1))
            if rank == 2 and i == 3:
                (Path(logs) / "stopped-pid").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.01)


def test_a_stopped_rank_is_named_as_hung_and_the_job_ends(tmp_path: Path) -> None:
    """Rank 2 is stopped, not dead: its peers wait in a collective that never completes. Their heartbeat
    watch names rank 2 as hung (its pid, its state) within a few hang timeouts, long before the 120 s
    process-group timeout, and no healthy rank is reported as having died."""
    with pytest.raises(RankFailure):
        run_ranks(_stop_rank_2, 3, str(tmp_path), timeout_s=HANG_TIMEOUT_S * 6)
    stopped = tmp_path / "stopped-pid"
    pid = stopped.read_text()
    for rank in (0, 1):
        log = (tmp_path / f"rank-{rank}.log").read_text()
        assert "rank 2 (local_rank 2, host" in log and f"pid {pid}) is hung: no heartbeat for" in log, log
        assert "process state: stopped" in log and "died" not in log, log
        # named within a few heartbeat periods of the stop
        named_after = (tmp_path / f"rank-{rank}.log").stat().st_mtime - stopped.stat().st_mtime
        assert named_after < HANG_TIMEOUT_S * 3, named_after
    for d in Path("/tmp").glob("dsx3d-job-*"):  # the job's host-local marker directory
        if (d / "hung-rank-2").is_file() and f"pid {pid})" in (d / "hung-rank-2").read_text():
            shutil.rmtree(d, ignore_errors=True)
