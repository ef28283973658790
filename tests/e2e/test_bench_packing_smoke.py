"""scripts/bench/packing.py in quick mode: packing lowers the padding fraction, both sides train (finite
losses, the same examples' tokens counted), and the report renders the section."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("warm")


def test_packing_bench_quick() -> None:
    from scripts.bench import packing as bench_packing
    from scripts.bench.report_packing import packing

    r = bench_packing.main(["--quick", "--rounds", "2", "--no-write"])
    pad = r["padding_fraction"]
    assert 0 <= pad["packed"] < pad["padded"] < 1, pad
    assert r["packed_over_padded"]["pairs"] == 2 and r["packed_over_padded"]["median"] > 0
    assert all(v > 0 for v in r["real_tokens_per_s"].values())
    assert any("Packed / padded" in line for line in packing(r))
