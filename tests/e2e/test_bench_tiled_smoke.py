"""scripts/bench/tiled_loss.py in quick mode: tiles lower the last stage's peak of live tensors, both runs reach
the same loss, and the report renders the section."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("warm")


def test_tiled_loss_bench_quick() -> None:
    from scripts.bench import tiled_loss as bench
    from scripts.bench.report_tiled import tiled_loss

    r = bench.main(["--quick", "--rounds", "1", "--tile", "64", "--no-write"])
    assert r["losses"]["full"] == pytest.approx(r["losses"]["tiled"], rel=1e-6)
    # held to the allocator's peak, not the resident set: a child forked from the suite's process once saw the full
    # run's step grow its RSS by 62 MiB and the tiled one's by 0 (190 and 47 MiB here, alone)
    allocated = r["median_peak_allocated_mib"]
    # the full run holds the logits, their log-softmax and their gradient at once (measured 3.04x)
    assert allocated["full"] > 2.5 * r["full_logits_fp32_mib"], allocated
    # a tile holds 64 x 32000 logits; what remains is the head's weight gradient and Adam's update (measured 0.25)
    assert r["ratio_tiled_over_full_allocated"] < 0.4, allocated
    assert any("Tiled / full peak" in line for line in tiled_loss(r))
