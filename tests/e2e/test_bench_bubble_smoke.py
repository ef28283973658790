"""The bubble benchmark in quick mode (2 ranks, one round): every schedule gets a row with its bound, its
simulation with the measured costs and the time its stages spent waiting; the auto row carries the costs all
ranks agreed on, and the report renders the result."""

from __future__ import annotations

import pytest

from scripts.bench import bubble
from scripts.bench.report_bubble import bubble as render

pytestmark = pytest.mark.usefixtures("warm")


def test_quick_bubble_rows() -> None:
    r = bubble.main(["--quick", "--pp", "2", "--micro-batches", "4", "--rounds", "1", "--no-write"])
    rows = r["runs"]["2"]["rows"]
    assert [row["schedule"] for row in rows] == ["1f1b", "zb-h1", "zb-h1-auto"]
    for row in rows:
        assert 0 <= row["analytic"] < 1 and 0 <= row["simulated"] < 1
        assert len(row["idle_per_stage"]) == 2 and all(x > 0 for x in row["wall_ms_per_micro_batch"]["F"])
        assert row["wall_ms_per_micro_batch"]["recv"][1] > 0  # the last stage receives activations
    auto = rows[2]
    assert len(auto["measured_costs_ms"]["f"]) == 2 and min(auto["measured_costs_ms"]["w"]) > 0
    assert auto["step_ratio_vs_1f1b"]["min"] <= auto["step_ratio_vs_1f1b"]["max"]
    assert rows[0]["cpu_ms_per_pass"]["W"] == [None, None]  # 1F1B has no separate W pass
    text = "\n".join(render(r, []))
    assert "zb-h1 auto | 2 | 4" in text
