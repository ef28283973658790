"""The estimator charges DeepSpeed's fp32 gradient buffer exactly where DeepSpeed's engine picks the optimizer
that keeps it: `dsx3d.recipe.ds_optimizer` against `DeepSpeedEngine._do_optimizer_sanity_check` itself, and the ZeRO
paper's fp16 figures through the estimator and the CLI."""

from __future__ import annotations

import io
import itertools
import json
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch

from dsx3d.cli import main
from dsx3d.estimate import Setup, estimate, model_state_bytes, shape_from_params
from dsx3d.recipe.ds_optimizer import optimizer_wrapper

_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _engine_pick(dtype: str, stage: int, accum: str | None, pipeline: bool, offload: bool):
    """DeepSpeed's own decision, run on a stand-in engine that answers the questions the method asks."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    stub = SimpleNamespace(
        get_data_types=lambda: (_TORCH[dtype], _TORCH[accum or dtype]),
        zero_optimization=lambda: stage > 0,
        zero_optimization_stage=lambda: stage,
        zero_cpu_offload=lambda: offload,
        zero_compute_grad_norm=lambda: True,
        zero_allow_untested_optimizer=lambda: True,
        pipeline_parallelism=pipeline,
        global_rank=0,
    )
    return DeepSpeedEngine._do_optimizer_sanity_check(stub, torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]))


@pytest.mark.parametrize(
    ("dtype", "stage", "accum", "pipeline", "offload"),
    list(itertools.product(("fp32", "fp16", "bf16"), (0, 1, 2, 3), (None, "fp32", "fp16", "bf16"), (False, True), (False, True))),
)
def test_pick_matches_deepspeed(dtype, stage, accum, pipeline, offload, monkeypatch):
    import deepspeed.runtime.zero.utils as zero_utils

    monkeypatch.setattr(zero_utils.dist, "get_rank", lambda *a, **k: 0)  # no process group in this test
    try:
        expected = _engine_pick(dtype, stage, accum, pipeline, offload)
    except NotImplementedError:
        with pytest.raises(ValueError):
            optimizer_wrapper(dtype, stage, accum, pipeline=pipeline, cpu_offload=offload)
        return
    assert optimizer_wrapper(dtype, stage, accum, pipeline=pipeline, cpu_offload=offload) == expected


@pytest.mark.parametrize(("stage", "paper_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_fp16_zero_paper_figures(stage, paper_gb):
    """ZeRO Fig. 1 (fp16 mixed precision, 7.5B parameters, Nd = 64): (2 + 2 + 12/Nd) N at stage 1. dsx3d's
    fp16 config accumulates in fp16, and DeepSpeed's fp16 ZeRO optimizer keeps no fp32 gradient buffer."""
    est = estimate(shape_from_params(7.5e9), Setup(dp=64, zero_stage=stage, dtype="fp16"))
    assert round(est.model_states_gb, 1) == paper_gb
    # even with fp32 accumulation asked for, DeepSpeed's fp16 path is its ZeRO optimizer (no buffer)
    fp32_accum = model_state_bytes(7.5e9, dp=64, zero_stage=stage, dtype="fp16", fp32_grad_accum=True)
    assert round(fp32_accum.total / 1e9, 1) == paper_gb


def test_bf16_zero1_keeps_the_buffer():
    """bf16 + ZeRO-1 with dsx3d's fp32 accumulation: BF16_Optimizer, 4 more bytes per parameter."""
    est = estimate(shape_from_params(7.5e9), Setup(dp=64, zero_stage=1, dtype="bf16"))
    assert est.model_states_gb == pytest.approx(31.4 + 30.0, abs=0.1)


def test_cli_fp16_zero1():
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--zero-stage", "1", "--dtype", "fp16", "--json"]) == 0
    report = json.loads(out.getvalue())
    assert round(report["model_states_gb"], 1) == 31.4
