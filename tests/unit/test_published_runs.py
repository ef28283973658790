"""Published runs the physical model is held to (`dsx3d.estimate.published`): Megatron-LM SC'21 Table 1. Pure: no processes.

The zero-bubble paper's Table 4 is in test_published_zb.py."""

from __future__ import annotations

import functools

import pytest

from dsx3d.estimate.devices import get_profile
from dsx3d.estimate.published import (
    MEGATRON_TABLE_1,
    Forecast,
    discordant_pairs,
    forecast_megatron,
    rank_correlation,
)

PROFILE = get_profile("a100-80")
"""One profile for the whole table: the datasheet A100 80 GB with the default efficiencies, nothing fitted."""


@functools.cache
def forecasts() -> tuple[Forecast, ...]:
    return tuple(forecast_megatron(row, PROFILE) for row in MEGATRON_TABLE_1)


def test_rows_are_the_published_ones():
    assert len(MEGATRON_TABLE_1) == 10
    for row in MEGATRON_TABLE_1:
        assert row.dp * row.tp * row.pp == row.gpus and row.batch % (row.dp * row.micro_batch) == 0
        assert "Table 1" in row.source
    # the table's aggregate PFLOP/s column is per-GPU x GPUs: 4.4 for 1.7B ... 502.0 for 1T
    assert MEGATRON_TABLE_1[0].tflops_per_gpu * MEGATRON_TABLE_1[0].gpus / 1e3 == pytest.approx(4.4, abs=0.05)
    assert MEGATRON_TABLE_1[-1].tflops_per_gpu * MEGATRON_TABLE_1[-1].gpus / 1e3 == pytest.approx(502.0, rel=0.005)
    for row in MEGATRON_TABLE_1:  # both published figures agree, and together they rank every row strictly
        assert abs(row.ranked_tflops_per_gpu - row.tflops_per_gpu) <= 0.5
        assert abs(row.ranked_tflops_per_gpu * row.gpus / 1e3 - row.aggregate_pflops) <= 0.05
    assert len({r.ranked_tflops_per_gpu for r in MEGATRON_TABLE_1}) == len(MEGATRON_TABLE_1)


@pytest.mark.parametrize("index", range(len(MEGATRON_TABLE_1)), ids=[r.name for r in MEGATRON_TABLE_1])
def test_megatron_row_within_ten_percent(index):
    f = forecasts()[index]
    assert abs(f.time_ratio - 1) <= 0.10, f"{f.row.name}: forecast {f.tflops_per_gpu:.1f} vs published {f.row.tflops_per_gpu} TFLOP/s"


def _ranking() -> tuple[float, list[tuple[str, str]]]:
    fc = [f.tflops_per_gpu for f in forecasts()]
    pub = [r.ranked_tflops_per_gpu for r in MEGATRON_TABLE_1]
    return rank_correlation(fc, pub), discordant_pairs([r.name for r in MEGATRON_TABLE_1], fc, pub)


def test_megatron_ranking_agrees_broadly():
    rho, wrong = _ranking()
    assert rho >= 0.9
    assert len(wrong) <= 5, wrong  # of the 45 pairs; the ones left are named in the expected failure below


@pytest.mark.xfail(
    strict=True,
    reason="open (issue 35): 5 of 45 pairs ordered the other way, where the published rows differ by 0.3-2%: "
    "39.1B below 1.7B, 3.6B and 18.4B; 76.1B above 7.5B; 529.6B above 1T; the 2021 scripts, DDP, the DP ring's "
    "bandwidth and the interleaved p2p were re-checked and do not reorder them (docs/design/physical-time-model.md)",
)
def test_megatron_ranking_exactly_as_published():
    rho, wrong = _ranking()
    assert not wrong
    assert rho == pytest.approx(1.0)


def test_rank_correlation():
    assert rank_correlation([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert rank_correlation([1, 2, 2], [1, 2, 2]) == pytest.approx(1.0)
