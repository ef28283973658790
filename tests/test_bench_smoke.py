"""The communication benchmark in quick mode: the TP and PP bytes counted on every rank of a tp2 x pp2 run
equal `dsx3d.estimate`'s analytic volumes exactly. Guards the estimator's traffic model (it once counted 4
TP all-reduces per layer where dsx3d issues 7, and left out the token ids sent with the activations) and
the counting hook itself (a hook that saw nothing would fail the non-zero check)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_comm  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm")


def test_counted_tp_and_pp_bytes_equal_the_estimate() -> None:
    result = bench_comm.run(quick=True, dims=(1, 2, 2))
    assert {row["stage"] for row in result["ranks"]} == {0, 1}
    for row in result["ranks"]:
        for kind in ("tp", "pp"):
            assert row[kind]["analytic"] > 0, row
            assert row[kind]["measured"] == pytest.approx(row[kind]["analytic"], rel=1e-12, abs=0), row


def test_estimator_knows_the_tp_styles_the_engine_implements() -> None:
    """The estimator keeps its own copy of the implemented TP styles (it imports no model code); a style added
    to the engine without it would be estimated as a module kept whole, with no TP traffic."""
    from dsx3d.estimate.model import _TP_STYLES
    from dsx3d.models.plans import SUPPORTED_TP_STYLES

    assert set(_TP_STYLES) == SUPPORTED_TP_STYLES
