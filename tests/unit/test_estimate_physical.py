"""The physical time model: kernels and collectives, the step's terms, interleaved 1F1B, profiles, the CLI. No processes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from dsx3d.cli import main
from dsx3d.errors import UserError
from dsx3d.estimate import Hardware, Setup, estimate, interleaved, kernels, shape_from_hf_config
from dsx3d.estimate.devices import PROFILES, get_profile, load_profile, profile_from_dict, profile_json

A100 = get_profile("a100-80")
SHAPE = shape_from_hf_config(
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=32, vocab_size=32000)
)


def test_every_profile_names_its_sources():
    for profile in PROFILES.values():
        assert profile.sources.get("peak_tflops"), profile.name
        assert profile.peak_tflops > 0 and profile.hbm_gbps > 0


def test_gemm_roofline_compute_and_memory_bound():
    big = kernels.gemm_seconds(13824, 8192, 1280, A100)  # 108 x 10 whole tiles: 10 full waves
    flops = 2 * 13824 * 8192 * 1280
    assert big == pytest.approx(flops / (312e12 * A100.matmul_efficiency) + 4e-6, rel=1e-6)
    slow_memory = replace(A100, hbm_gbps=50.0)  # the same GEMM on a device starved of bandwidth: memory bound
    nbytes = 2 * (13824 * 8192 + 8192 * 1280 + 13824 * 1280)
    assert kernels.gemm_seconds(13824, 8192, 1280, slow_memory) == pytest.approx(
        nbytes / (50e9 * A100.memory_efficiency) + 4e-6, rel=1e-6
    )


def test_tile_and_wave_quantisation():
    assert kernels.quantisation(128 * 108, 128, A100) == 1.0  # one full wave of whole tiles
    assert kernels.quantisation(129, 128, A100) == pytest.approx(129 / 256 * 2 / 108)
    # one more row of tiles opens an 11th wave
    assert kernels.gemm_seconds(13825, 4096, 1280, A100) > kernels.gemm_seconds(13824, 4096, 1280, A100) * 1.08


def test_allreduce_picks_ring_for_large_and_tree_for_small_messages():
    assert kernels.allreduce_seconds(1e9, 64, A100, crosses_node=True)[1] == "ring"
    assert kernels.allreduce_seconds(1e3, 64, A100, crosses_node=True)[1] == "tree"
    inside = kernels.allreduce_seconds(1e8, 8, A100, crosses_node=False)[0]
    across = kernels.allreduce_seconds(1e8, 8, A100, crosses_node=True)[0]
    assert across > 5 * inside  # 25 GB/s network against 300 GB/s NVLink


def _physical(setup: Setup, device: str = "a100-80") -> object:
    return estimate(SHAPE, setup, Hardware(device=get_profile(device)))


def test_terms_add_up_to_the_step():
    est = _physical(Setup(dp=2, tp=2, pp=2, grad_accum=8, seq_len=2048, activation_checkpointing=True))
    shown = {k: v for k, v in est.terms.items() if k != "dp_overlapped"}
    assert sum(shown.values()) == pytest.approx(est.step_time_s)
    assert {"matmul", "attention", "elementwise", "recompute", "tp", "pp", "bubble", "dp", "optimizer"} <= set(shown)
    assert est.device == "a100-80" and 0 < est.mfu < 1


def test_tp_across_nodes_costs_more_than_inside():
    inside = _physical(Setup(dp=1, tp=8, seq_len=2048)).terms["tp"]
    across = estimate(SHAPE, Setup(dp=1, tp=8, seq_len=2048), Hardware(device=get_profile("a100-80"), gpus_per_node=4))
    assert across.terms["tp"] > 5 * inside


def test_dp_overlap_hides_the_reduction_under_the_backward():
    plain = _physical(Setup(dp=16, grad_accum=1, seq_len=2048))
    overlapped = _physical(Setup(dp=16, grad_accum=1, seq_len=2048, dp_overlap=True))
    assert overlapped.terms["dp"] < plain.terms["dp"]
    hidden = overlapped.terms["dp_overlapped"]
    assert overlapped.terms["dp"] == pytest.approx(plain.terms["dp"] - hidden + A100.overlap_penalty * hidden)


def test_flash_attention_is_faster_than_eager_at_long_sequences():
    eager = _physical(Setup(seq_len=8192)).terms["attention"]
    flash = _physical(Setup(seq_len=8192, flash_attention=True)).terms["attention"]
    assert flash < eager


def test_faster_devices_are_faster():
    times = [_physical(Setup(dp=8, tp=1, seq_len=2048), name).step_time_s for name in ("a100-80", "h100-sxm", "b200")]
    assert times == sorted(times, reverse=True)


def test_interleaved_bubble_is_the_papers_expression():
    p, m, v = 8, 32, 4
    assert interleaved.pipeline_units(p, m, v) == m + (p - 1) / v
    # Narayanan et al. 2021: bubble time over ideal time = (p - 1) / (v * m)
    units = interleaved.pipeline_units(p, m, v)
    assert (units - m) / m == pytest.approx((p - 1) / (v * m))
    assert interleaved.pipeline_units(p, m, 1) == m + p - 1
    assert interleaved.held_micro_batches(0, p, m, 1) == p


def test_interleaved_schedule_shortens_the_bubble_and_sends_more():
    one = _physical(Setup(dp=1, pp=4, grad_accum=8, seq_len=2048))
    inter = _physical(Setup(dp=1, pp=4, grad_accum=8, seq_len=2048, schedule=interleaved.NAME, virtual_stages=2))
    assert inter.terms["bubble"] < one.terms["bubble"]
    assert inter.terms["pp"] > one.terms["pp"]
    assert inter.bubble_fraction == pytest.approx(1 - 8 / (8 + 3 / 2))


def test_without_a_device_the_legacy_model_is_unchanged():
    legacy = estimate(SHAPE, Setup(dp=2, pp=2, grad_accum=4), Hardware())
    assert legacy.terms == {} and legacy.device is None
    assert legacy.step_time_s == pytest.approx(legacy.time_s["pipeline"] + legacy.time_s["dp"] + legacy.time_s["tied"])


def test_profile_file_round_trip_and_refusals(tmp_path):
    path = tmp_path / "p.json"
    fitted = replace(get_profile("h100-sxm"), name="h100-sxm+fitted", matmul_efficiency=0.61)
    path.write_text(profile_json(fitted, {"compute_scale": 0.9}))
    loaded = load_profile(str(path))
    assert loaded == fitted
    with pytest.raises(UserError):
        profile_from_dict({"name": "x", "peak_tflops": -1})
    with pytest.raises(UserError):
        profile_from_dict({"name": "x", "bogus": 1})
    with pytest.raises(UserError):
        get_profile("tpu")


def test_cli_prints_the_terms(capsys):
    args = ["estimate", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--dp", "8", "--pp", "2", "--grad-accum", "8"]
    assert main([*args, "--device", "h100-sxm", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "where the time goes (h100-sxm" in out and "bubble" in out and "stage 1:" in out
    assert main([*args, "--device", "h100-sxm", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "h100-sxm" and data["terms"]["matmul"] > 0


def test_the_steps_scalar_collectives_are_latency_terms():
    """The gradient norm's and the loss's few-byte collectives: none on one rank, one all-reduce over TP, the
    norm's and the loss's broadcast over the pipeline, the norm's and the loss's mean over DP."""
    cpu = get_profile("cpu")
    a = cpu.intra_latency_us * 1e-6

    def scalars(dp: int, tp: int, pp: int) -> float:
        setup = Setup(dp=dp, tp=tp, pp=pp, micro_batch_size=2, grad_accum=4, seq_len=64, dtype="fp32")
        return estimate(SHAPE, setup, Hardware(device=cpu, gpus_per_node=8)).terms["scalars"]

    assert scalars(1, 1, 1) == 0.0
    assert scalars(1, 2, 1) == pytest.approx(2 * a, rel=1e-3)  # a 2-rank all-reduce: two ring steps
    assert scalars(1, 1, 2) == pytest.approx(4 * a, rel=1e-3)
    assert scalars(2, 1, 1) == pytest.approx(4 * a, rel=1e-3)


def test_dsx3ds_forward_message_is_two_sends_and_megatrons_one():
    """DeepSpeed's engine sends the hidden states and the token ids, a latency each; Megatron the first only."""
    from dsx3d.estimate import physical

    cpu = get_profile("cpu")
    setup = Setup(pp=2, micro_batch_size=2, grad_accum=4, seq_len=64, dtype="fp32")

    def first_stage_pp(s: Setup) -> float:
        return physical.stage_terms(SHAPE, s, cpu, 8, 0, 0, 4).forward["pp"]

    ids = 2 * 64 * 8 / (cpu.intra_node_gbps * 1e9 * cpu.link_efficiency)  # int64 token ids of one micro-batch
    difference = first_stage_pp(setup) - first_stage_pp(replace(setup, token_ids_sent=False))
    assert difference == pytest.approx(cpu.intra_latency_us * 1e-6 + ids)


def test_tp_latency_steps_count_every_call_the_engine_issues():
    """The tiny recipe's Llama (4 layers) on one stage at tp 2: with sequence parallelism 8 halves and 2 norm
    all-reduces a layer, 4 halves at the ends, the cross-entropy's 3 all-reduces and the final norm's: 60 ring
    steps, as `scripts.bench.counting` counts them in a run; without it 4 all-reduces a layer, 2 at the ends
    and the cross-entropy's 3: 42."""
    from dsx3d.estimate import timing

    tiny = shape_from_hf_config(
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=2048)
    )
    steps = {sp: timing.tp_latency_steps_per_micro_batch(
        tiny, layers=4, tp=2, first=True, last=True, checkpointing=False, sequence_parallel=sp) for sp in (True, False)}
    assert steps == {True: 60, False: 42}
