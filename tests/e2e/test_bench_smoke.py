"""The communication benchmark in quick mode: the TP and PP bytes counted on every rank of a tp2 x pp2 run
equal `dsx3d.estimate`'s analytic volumes exactly, and the TP calls' latency steps its count. Guards the estimator's traffic model (it once counted 4
TP all-reduces per layer where dsx3d issues 7, and left out the token ids sent with the activations) and
the counting hook itself (a hook that saw nothing would fail the non-zero check)."""

from __future__ import annotations

import pytest

from scripts.bench import comm as bench_comm

pytestmark = pytest.mark.usefixtures("warm")


def test_counted_tp_and_pp_bytes_equal_the_estimate() -> None:
    result = bench_comm.run(quick=True, dims=(1, 2, 2))
    assert {row["stage"] for row in result["ranks"]} == {0, 1}
    for row in result["ranks"]:
        for kind in ("tp", "pp"):
            assert row[kind]["analytic"] > 0, row
            assert row[kind]["measured"] == pytest.approx(row[kind]["analytic"], rel=1e-12, abs=0), row
        # the TP calls' latency steps (sequence parallelism: 36 halves and 16 or 32 all-reduces a step)
        assert row["tp_latency_steps"]["measured"] == row["tp_latency_steps"]["analytic"] > 0, row


def test_moe_tp_bytes_exact_and_all_to_all_counted() -> None:
    """MoE at dp 2 x tp 2 x pp 2, ep 2: the experts regions' all-reduces (output forward, input and routing
    weights backward) are counted by the estimator to the byte; the EP all-to-alls are seen and attributed to
    the EP groups, within routing imbalance of the estimator's even-spread figure. (pp 2: at pp 1 the
    model-parallel group, over which ZeRO sums gradient-norm scalars, is the TP group itself.)"""
    result = bench_comm.run(quick=True, dims=(2, 2, 2, 2), family="mixtral", config_overrides={"num_local_experts": 8})
    for row in result["ranks"]:
        assert row["tp"]["measured"] == pytest.approx(row["tp"]["analytic"], rel=1e-12, abs=0), row
        assert row["tp_latency_steps"]["measured"] == row["tp_latency_steps"]["analytic"] > 0, row
        assert 0.5 < row["ep"]["measured"] / row["ep"]["analytic"] < 2.0, row
    assert result["layout"]["ep"] == 2


def test_lora_bench_measures_adapters_only() -> None:
    """scripts/bench/lora.py in quick mode at tp 2: LoRA's optimizer state and gradients are those of the
    adapters alone (fp32 Adam: two moments), a small fraction of full fine-tuning's."""
    from scripts.bench import lora as bench_lora

    r = bench_lora.main(["--quick", "--layout", "1,2,1", "--no-write"])
    for run in ("full", "lora_run"):
        for trainable, state, grads in zip(*(r[run][k] for k in ("trainable_params", "optimizer_state_bytes", "grad_bytes")), strict=True):
            assert grads == 4 * trainable and 8 * trainable <= state <= 8 * trainable + 64, (run, r[run])
    assert 0 < r["ratio_lora_over_full"]["optimizer_state_bytes"] < 0.5, r["ratio_lora_over_full"]
