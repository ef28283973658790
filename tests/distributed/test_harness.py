"""The fork harness names where a hung rank was, so a deadlock in a test is diagnosable from CI's log."""

from __future__ import annotations

import time

import pytest

from dsx3d.verify.harness import RankFailure, run_ranks


def _waits_forever_on_rank_1(rank: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_a_hung_rank_reports_its_stack() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(_waits_forever_on_rank_1, 2, timeout_s=5.0)
    message = str(caught.value)
    assert "hung: [1]" in message or "hung: [0, 1]" in message
    assert "rank 1 hung at" in message and "_waits_forever_on_rank_1" in message
