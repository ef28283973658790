"""The pipeline engine without ZeRO-1's bookkeeping gradient hooks (dsx3d/pipeline/lean_step.py): they are gone
where they only count, kept where they do work, and training still equals single-process HF (dp 2 reduces
through ZeRO-1; zb-h1 defers weight gradients past them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline.lean_step import bookkeeping_only_hooks
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase, case_recipe, run_verify


def DeepSpeedZeroOptimizer(**flags: bool) -> object:  # noqa: N802 - named as the class the check reads
    cls = type("DeepSpeedZeroOptimizer", (), {})
    opt = cls()
    opt.__dict__.update({"_grad_acc_hooks": [object()], **flags})
    return opt


def test_only_pure_bookkeeping_hooks_are_removable() -> None:
    assert bookkeeping_only_hooks(DeepSpeedZeroOptimizer())
    for flag in ("partition_gradients", "overlap_comm", "cpu_offload", "use_grad_accum_attribute", "zenflow"):
        assert not bookkeeping_only_hooks(DeepSpeedZeroOptimizer(**{flag: True})), flag
    assert not bookkeeping_only_hooks(SimpleNamespace(_grad_acc_hooks=[object()]))  # BF16_Optimizer and others


def _hooks_left(rank: int, case: ParityCase) -> tuple[int, int]:
    from dsx3d.engine.builder import build_engine

    engine = build_engine(case_recipe(case), hf_config=case.config)
    ds = engine.ds_engine
    per_param = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in ds.module.parameters())
    return len(ds.optimizer._grad_acc_hooks), per_param


@pytest.mark.slow
def test_zero1_pipeline_engine_has_no_gradient_hooks() -> None:
    case = ParityCase(tiny_config("llama"), dp=1, tp=1, pp=2, micro_batches=2, steps=1)
    assert run_ranks(_hooks_left, 2, case) == [(0, 0), (0, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_parity_without_the_hooks_at_dp2(schedule: str) -> None:
    case = ParityCase(tiny_config("llama"), dp=2, tp=1, pp=2, micro_batches=3, steps=2, schedule=schedule)
    assert all(r.ok for r in run_verify(case))
