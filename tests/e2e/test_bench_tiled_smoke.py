"""scripts/bench/tiled_loss.py in quick mode: tiles lower the last stage's peak, both runs reach the same loss,
and the report renders the section."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("warm")


def test_tiled_loss_bench_quick() -> None:
    from scripts.bench import tiled_loss as bench
    from scripts.bench.report_tiled import tiled_loss

    r = bench.main(["--quick", "--rounds", "1", "--tile", "64", "--no-write"])
    assert r["losses"]["full"] == pytest.approx(r["losses"]["tiled"], rel=1e-6)
    # the full run holds at least the logits and their gradient (measured 2.0-3.0x; RSS granularity varies)
    assert r["median_peak_over_start_mib"]["full"] > 1.5 * r["full_logits_fp32_mib"], r["median_peak_over_start_mib"]
    assert r["ratio_tiled_over_full"] < 0.5, r["median_peak_over_start_mib"]
    assert any("Tiled / full peak" in line for line in tiled_loss(r))
