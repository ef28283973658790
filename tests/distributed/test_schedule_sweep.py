"""Every pipeline schedule on configs nobody here picked (`dsx3d.verify.sweep.schedule_sweep_cases`: a dense
family with awkward sizes, 2 pp layers, pp 2 or 4, tp 1 or 2, dp 1 or 2, fp32 or bf16): `dsx3d verify` passes.
CI runs one seeded zb-v case; DSX3D_SWEEP=1 runs DSX3D_SWEEP_COUNT cases (default 16) round-robin over the
registry's schedules."""

from __future__ import annotations

import os

import pytest

from dsx3d.pipeline.zb_v import NAME as ZB_V
from dsx3d.verify.parity import ParityCase, case_recipe, run_verify
from dsx3d.verify.sweep import SweepCase, schedule_sweep_cases

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

SEED = int(os.environ.get("DSX3D_SWEEP_SEED", "20261206"))
CASES = (
    schedule_sweep_cases(int(os.environ.get("DSX3D_SWEEP_COUNT", "16")), seed=SEED)
    if os.environ.get("DSX3D_SWEEP")
    else schedule_sweep_cases(1, seed=SEED, schedules=(ZB_V,))
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_every_schedule_passes_verify_on_generated_configs(case: SweepCase) -> None:
    dp, tp, pp = case.layout
    parity = ParityCase(
        case.config(), dp=dp, tp=tp, pp=pp, zero_stage=case.zero_stage, steps=2, dtype=case.dtype,
        schedule=case.schedule, micro_batches=case.micro_batches,
    )
    assert case_recipe(parity).parallel.schedule == case.schedule
    for r in run_verify(parity):
        assert r.ok, r.to_dict()
