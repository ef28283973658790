"""The communication benchmark in quick mode: the TP and PP bytes counted on every rank of a tp2 x pp2 run
equal `dsx3d.estimate`'s analytic volumes exactly. Guards the estimator's traffic model (it once counted 4
TP all-reduces per layer where dsx3d issues 7, and left out the token ids sent with the activations) and
the counting hook itself (a hook that saw nothing would fail the non-zero check)."""

from __future__ import annotations

import pytest

from scripts.bench import comm as bench_comm

pytestmark = pytest.mark.usefixtures("warm")


def test_counted_tp_and_pp_bytes_equal_the_estimate() -> None:
    result = bench_comm.run(quick=True, dims=(1, 2, 2))
    assert {row["stage"] for row in result["ranks"]} == {0, 1}
    for row in result["ranks"]:
        for kind in ("tp", "pp"):
            assert row[kind]["analytic"] > 0, row
            assert row[kind]["measured"] == pytest.approx(row[kind]["analytic"], rel=1e-12, abs=0), row
