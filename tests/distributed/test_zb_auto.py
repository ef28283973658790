"""`parallel.zb_costs: auto`: the engine times each stage's F, B and W in the first step, every rank agrees on
the same per-stage costs, and the order built from them from the second step on keeps parity with
single-process HF. Without the agreement (an all-reduce dropped) the ranks cannot build one order: refused."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline import zb_auto
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import (
    ParityCase,
    build_case_engine,
    make_batches,
    micro_batch,
)

pytestmark = pytest.mark.usefixtures("warm")


def _case(fam: str = "llama", tp: int = 1, pp: int = 2, m: int = 4) -> ParityCase:
    config = tiny_config(fam, tie_word_embeddings=True) if fam == "qwen3" else tiny_config(fam)
    return ParityCase(config, dp=1, tp=tp, pp=pp, micro_batches=m, steps=5, schedule="zb-h1", zb_costs="auto")


def _worker(rank: int, case: ParityCase, state: dict[str, torch.Tensor], batches: torch.Tensor) -> dict[str, Any]:

    engine = build_case_engine(case, state)
    costs = []
    for batch in batches:
        dp = engine.placement.dp
        engine.train_step(iter([(ids, ids) for ids in (micro_batch(case, batch, k, dp) for k in range(case.micro_batches))]))
        costs.append(getattr(engine.ds_engine, "dsx3d_zb_costs", None))
    return {"stage": engine.placement.pp, "costs": costs}


def _state(case: ParityCase) -> dict[str, torch.Tensor]:
    from dsx3d.verify.parity import build_reference, hf_name

    return {hf_name(k): v.detach().clone() for k, v in build_reference(case).state_dict().items()}


def test_every_rank_agrees_on_the_measured_costs() -> None:
    case = _case(tp=2)
    results = run_ranks(_worker, case.world_size, case, _state(case), make_batches(case))
    first = results[0]["costs"]
    assert first[:3] == [None, None, None]  # equal costs; the second and third steps are timed
    agreed = first[3]
    assert agreed is not None and first[4] == agreed  # measured once, then kept
    assert all(r["costs"] == first for r in results)  # every rank builds the same order
    assert len(agreed.f) == case.pp and min(agreed.f + agreed.b + agreed.w) > 0
    assert agreed.b != agreed.f  # durations, not the equal-cost placeholder


def test_without_the_agreement_the_ranks_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank alone knows only its own stage's costs: the order could differ between ranks."""
    monkeypatch.setattr(zb_auto.comm, "all_reduce_sum", lambda tensor, group=None: tensor)
    case = _case()
    with pytest.raises(Exception, match="no F, B and W durations were measured"):
        run_ranks(_worker, case.world_size, case, _state(case), make_batches(case))


@pytest.mark.parametrize(
    "fam,tp,pp,m", [("llama", 1, 2, 4)] + ([("qwen3", 2, 2, 5), ("llama", 1, 4, 8)] if os.environ.get("DSX3D_SWEEP") else [])
)
def test_parity_with_the_measured_order(fam: str, tp: int, pp: int, m: int) -> None:
    from test_zero_bubble import _ok

    assert _ok(_case(fam, tp, pp, m))
