"""The planner's margin: by how much its choice beats the runner-up and which term decides it. No processes."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from dsx3d.estimate import Hardware, Setup, shape_from_hf_config
from dsx3d.estimate.devices import get_profile
from dsx3d.planner.margin import describe, margin, step_terms
from dsx3d.planner.search import Cluster, plan_layouts

SHAPE = shape_from_hf_config(
    LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, vocab_size=32000)
)


@pytest.mark.parametrize("device", [None, "h100-sxm"])
def test_margin_names_the_runner_up_and_the_deciding_term(device):
    hw = Hardware(device=get_profile(device) if device else None)
    result = plan_layouts(
        SHAPE, Cluster(nodes=2, gpus_per_node=8, gpu_memory_gb=80), global_batch=64, seq_len=2048,
        hardware=hw, base=Setup(flash_attention=True), use_checker=False, max_micro_batch=4,
    )
    won = margin(result)
    assert won is not None
    assert won.speedup >= 1.0
    assert won.runner_up.group_key != result.ranked[0].group_key
    assert won.deciding_term in step_terms(won.runner_up.estimate)
    assert won.deciding_seconds == max(won.differences.values())
    assert sum(won.differences.values()) == pytest.approx(
        won.runner_up.estimate.step_time_s - result.ranked[0].estimate.step_time_s, rel=1e-6, abs=1e-9
    )
    assert "decided by" in describe(won)


def test_estimator_only_schedules_are_reported_never_picked():
    from dsx3d.estimate.schedules import ESTIMATOR_ONLY, runnable
    from dsx3d.planner.margin import describe_alternative, estimator_only_alternatives

    hw = Hardware(device=get_profile("a100-80"))
    result = plan_layouts(
        SHAPE, Cluster(nodes=1, gpus_per_node=8, gpu_memory_gb=80), global_batch=64, seq_len=2048,
        hardware=hw, base=Setup(flash_attention=True), use_checker=False, max_micro_batch=2,
    )
    assert all(runnable(c.setup.schedule) for c in result.ranked)
    piped = next(c for c in result.ranked if c.setup.pp > 1)
    others = estimator_only_alternatives(SHAPE, piped, hw, 80)
    assert {a.schedule for a in others} <= {*ESTIMATOR_ONLY, "interleaved-1f1b"} and others
    assert [a.speedup for a in others] == sorted((a.speedup for a in others), reverse=True)
    for a in others:
        assert a.speedup == pytest.approx(piped.estimate.step_time_s / a.estimate.step_time_s)
        assert ("estimator only" in describe_alternative(a)) != runnable(a.schedule)
    zb2 = next(a for a in others if a.schedule == "zb-2p")
    assert zb2.estimate.bubble_fraction == 0.0 and zb2.speedup > 1  # equal F/B/W: the ZB-H2 bubble is zero
