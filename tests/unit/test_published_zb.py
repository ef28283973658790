"""The zero-bubble paper's Table 4 (`dsx3d.estimate.published_zb`): every row's time and memory, and the ranking
of the four schedules at each model and micro-batch count. Pure: no processes.

The 28.3B rows (32 stages) of ZB-1p simulate the zb-h1 order over up to 256 micro-batches (tens of seconds):
those are `slow`."""

from __future__ import annotations

import functools

import pytest

from dsx3d.estimate import schedules, zero_bubble
from dsx3d.estimate.published import discordant_pairs, rank_correlation
from dsx3d.estimate.published_zb import MODELS, SCHEDULES, ZB_TABLE_4, ZBForecast, forecast_zb, zb_profile

PROFILE = zb_profile()
"""One profile for the whole table: the datasheet A100 80 GB with the default efficiencies and an assumed
100 Gb/s RoCE port across nodes (`published_zb.ROCE_GBPS`), nothing fitted."""
RANK_OPEN = {("6.2B", 64)}
"""The group the forecast orders differently: 6.2B at 64 micro-batches puts 1F1B-I (published 4.19) above ZB-1p
(4.20), 1% apart (4.58 against 4.53)."""


def _slow(row) -> bool:
    return row.model.gpus == 32 and row.method == "ZB-1p"


@functools.cache
def forecast(index: int) -> ZBForecast:
    return forecast_zb(ZB_TABLE_4[index], PROFILE)


def _params(slow_if=_slow):
    out = []
    for i, row in enumerate(ZB_TABLE_4):
        marks = [pytest.mark.slow] if slow_if(row) else []
        out.append(pytest.param(i, marks=marks, id=row.name.replace(" ", "-")))
    return out


def test_rows_are_the_published_ones():
    assert len(ZB_TABLE_4) == 48
    assert set(SCHEDULES) == {r.method for r in ZB_TABLE_4}
    for row in ZB_TABLE_4:
        assert "Table 4" in row.source and "ICLR 2024" in row.source
        assert len(row.model.stage_layers()) == row.model.gpus
    assert sum(MODELS["1.5B"].stage_layers()) == 22 and MODELS["28.3B"].stage_layers()[:2] == (1, 2)


@pytest.mark.parametrize("index", _params())
def test_zb_row_time_and_memory(index):
    f = forecast(index)
    assert abs(f.memory_ratio - 1) <= 0.15, f"{f.row.name}: {f.estimate.total_gb:.1f} GB vs {f.row.memory_gb}"
    assert abs(f.time_ratio - 1) <= 0.10, f"{f.row.name}: {f.samples_per_gpu_s:.3f} vs {f.row.samples_per_gpu_s}"


def _groups() -> list:
    keys = sorted({(r.model.name, r.micro_batches) for r in ZB_TABLE_4}, key=lambda k: (k[0], k[1]))
    return [
        pytest.param(k, id=f"{k[0]}-m{k[1]}", marks=[pytest.mark.slow] if MODELS[k[0]].gpus == 32 else [])
        for k in keys
    ]


@pytest.mark.parametrize("key", _groups())
def test_zb_schedules_ranked_as_published(key):
    idx = [i for i, r in enumerate(ZB_TABLE_4) if (r.model.name, r.micro_batches) == key]
    names = [ZB_TABLE_4[i].method for i in idx]
    fc = [forecast(i).samples_per_gpu_s for i in idx]
    pub = [ZB_TABLE_4[i].samples_per_gpu_s for i in idx]
    wrong = discordant_pairs(names, fc, pub)
    if key in RANK_OPEN:
        assert wrong == [("ZB-1p", "1F1B-I")]
        return
    assert not wrong
    assert rank_correlation(fc, pub) >= 0.94  # 1.0 where the record has no ties (1.5B m=32 ties ZB-1p and 1F1B-I)


def test_zb2p_model_is_the_papers_zb_h2():
    # Table 2: bubble (p - 1)(T_F + T_B - 2 T_W); peak (2p - 1) M_B on the first worker
    assert zero_bubble.pipeline_units(8, 24) == 24
    assert zero_bubble.pipeline_units(4, 8, (1.0, 2.0, 0.5)) == pytest.approx(8 + 3 * 2.0 / 3.5)
    assert zero_bubble.held_micro_batches(0, 8, 64) == 15
    assert zero_bubble.held_micro_batches(7, 8, 64) == 1 + 6
    assert zero_bubble.held_micro_batches(0, 8, 4) == 4
    assert not schedules.runnable(zero_bubble.NAME) and zero_bubble.NAME in schedules.ESTIMATOR_ONLY
    assert schedules.schedule_bubble(zero_bubble.NAME, 8, 24) == 0.0
