"""The estimator with context parallelism and the tiled loss: hand-computed formulas, properties over
generated configs of real families (a CI sample; DSX3D_SWEEP=1 for all), and `dsx3d estimate --cp`."""

from __future__ import annotations

import json
import os
import random

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from dsx3d.cli import main
from dsx3d.estimate import Hardware, Setup, estimate, layer_activation_bytes, shape_from_hf_config
from dsx3d.estimate.context_parallel import alltoall_bytes_per_micro_batch, kv_heads_held, logits_bytes
from dsx3d.estimate.memory import head_activation_bytes

QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True,
)  # fmt: skip


def _qwen3(**overrides):
    return shape_from_hf_config(Qwen3Config(**{**QWEN3_06B, **overrides}))


def test_alltoall_bytes_by_hand():
    # 2 layers, cp 2, tp 1, s 8, b 1, 4 heads, 2 KV heads, d 4, bf16: a rank holds 4 tokens of q, k, v, out =
    # 4 * (2*4 + 2*2) * 4 values * 2 bytes = 384 bytes, sends half of them forward and backward
    args = dict(layers=2, cp=2, tp=1, seq_len=8, micro_batch=1, num_heads=4, num_kv_heads=2, head_dim=4, width=2)
    assert alltoall_bytes_per_micro_batch(**args, checkpointing=False) == 2 * 2 * 0.5 * 384
    assert alltoall_bytes_per_micro_batch(**args, checkpointing=True) == 2 * 3 * 0.5 * 384
    assert alltoall_bytes_per_micro_batch(**{**args, "cp": 1}, checkpointing=False) == 0.0
    # cp 4 over 1 KV head per TP rank (tp 2, 2 KV heads): replicated to 8 heads; 2 tokens per rank
    four = alltoall_bytes_per_micro_batch(**{**args, "cp": 4, "tp": 2}, checkpointing=False)
    assert four == 2 * 2 * 0.75 * (2 * (2 * 4 + 2 * 8) * 4 / 2 * 2)


def test_kv_heads_held():
    assert kv_heads_held(8, tp=2, cp=1) == 8
    assert kv_heads_held(8, tp=2, cp=4) == 8  # 4 per TP rank, one per CP rank
    assert kv_heads_held(2, tp=2, cp=4) == 8  # 1 per TP rank, replicated on each of the 4 CP ranks


def test_logits_bytes_by_hand():
    # 4 tokens, 10 logits per rank: bf16 logits 2 + fp32 softmax 4 + transients 8 + fp32 copy 4 = 18 bytes each
    assert logits_bytes(tokens=4, vocab_per_rank=10, width=2) == 4 * 18 * 10
    assert logits_bytes(tokens=4, vocab_per_rank=10, width=4) == 4 * 16 * 10
    assert logits_bytes(tokens=4, vocab_per_rank=10, width=2, tile_tokens=3) == 3 * 18 * 10
    assert logits_bytes(tokens=4, vocab_per_rank=10, width=2, tile_tokens=100) == 4 * 18 * 10


def test_last_stage_logits_peak_qwen3_32k():
    """micro-batch 1 x 32768 / cp tokens x 151936 / tp logits: the figures the docs quote."""
    shape = _qwen3()
    v, h = 151936, 1024
    for cp, tp in ((1, 1), (2, 1), (4, 2)):
        tokens = 32768 / cp
        norm = 8 * h + 4  # RMSNorm, whole hidden (no sequence parallelism asked for)
        full = head_activation_bytes(shape, seq_len=32768, micro_batch=1, tp=tp, dtype="bf16", cp=cp)
        assert full == pytest.approx(tokens * (norm + 2 * h) + tokens * 18 * v / tp)
        tiled = head_activation_bytes(shape, seq_len=32768, micro_batch=1, tp=tp, dtype="bf16", cp=cp, loss_tile_tokens=1024)
        assert tiled == pytest.approx(tokens * (norm + 2 * h) + 1024 * 18 * v / tp)
    logits = logits_bytes(tokens=32768, vocab_per_rank=v, width=2)
    assert logits / 1e9 == pytest.approx(89.6, abs=0.1)  # the logits of one 32k sequence alone: 18 B x 32768 x 151936


def test_cp1_is_the_estimate_without_cp():
    shape = _qwen3(num_hidden_layers=8)
    base = Setup(dp=4, tp=2, pp=2, seq_len=4096, grad_accum=8)
    explicit = Setup(dp=4, tp=2, pp=2, seq_len=4096, grad_accum=8, cp=1, loss_tile_tokens=0)
    assert estimate(shape, base).to_dict() == estimate(shape, explicit).to_dict()
    assert estimate(shape, base).comm_bytes["cp"] == 0.0


def test_zero_states_and_dp_traffic_over_dp_x_cp():
    """cp ranks hold the same weights: ZeRO partitions and the gradient exchange run over dp x cp."""
    shape = _qwen3(num_hidden_layers=4)
    for zero in (1, 2, 3):
        with_cp = estimate(shape, Setup(dp=2, cp=2, zero_stage=zero, seq_len=4096))
        wide_dp = estimate(shape, Setup(dp=4, zero_stage=zero, seq_len=4096))
        assert with_cp.stages[0].optimizer_gb == pytest.approx(wide_dp.stages[0].optimizer_gb)
        assert with_cp.model_states_gb == pytest.approx(wide_dp.model_states_gb)
        assert with_cp.comm_bytes["dp"] == pytest.approx(wide_dp.comm_bytes["dp"])


def test_alltoall_time_intra_and_inter_node():
    shape = _qwen3(num_hidden_layers=4)
    hw = Hardware(intra_node_gbps=400, inter_node_gbps=50)
    setup = Setup(dp=1, cp=4, seq_len=8192, grad_accum=2)
    inside = estimate(shape, setup, hw)
    across = estimate(shape, setup, Hardware(intra_node_gbps=400, inter_node_gbps=50, gpus_per_node=2))
    sent = 2 * alltoall_bytes_per_micro_batch(
        layers=4, cp=4, tp=1, seq_len=8192, micro_batch=1, num_heads=16, num_kv_heads=8, head_dim=128, width=2,
        checkpointing=False,
    )  # fmt: skip
    assert inside.comm_bytes["cp"] == pytest.approx(sent)
    assert inside.time_s["cp"] == pytest.approx(sent / 400e9)
    assert across.time_s["cp"] == pytest.approx(sent / 50e9)  # the CP group spans 2 nodes of 2 GPUs


def test_cp_needs_no_ep():
    from dsx3d.errors import UserError

    with pytest.raises(UserError, match="cp"):
        estimate(_qwen3(num_hidden_layers=2), Setup(dp=2, ep=2, cp=2))


def _family_configs():
    """Configs of real families with head counts that cp can split, dimensions drawn at random."""
    rng = random.Random(21)
    kinds = (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)
    out = []
    for i in range(40 if os.environ.get("DSX3D_SWEEP") == "1" else 6):
        heads = rng.choice((8, 16, 32))
        kv = rng.choice([k for k in (1, 2, 4, 8, heads) if heads % k == 0])
        head_dim = rng.choice((32, 64, 128))
        cls = kinds[i % len(kinds)]
        out.append(
            cls(
                hidden_size=heads * head_dim,
                intermediate_size=rng.choice((2, 3, 4)) * heads * head_dim,
                num_hidden_layers=rng.choice((2, 4, 8)),
                num_attention_heads=heads,
                num_key_value_heads=kv,
                head_dim=head_dim,
                vocab_size=rng.choice((1000, 32003, 151936)),
                tie_word_embeddings=rng.random() < 0.5,
            )
        )
    return out


@pytest.mark.parametrize("config", _family_configs(), ids=lambda c: f"{c.model_type}-a{c.num_attention_heads}kv{c.num_key_value_heads}")
@pytest.mark.parametrize("flash", [True, False])
def test_activations_split_by_cp(config, flash):
    """Per layer, cp divides what a rank keeps by exactly cp unless a fused attention keeps replicated KV heads
    (then by less); per stage and in peak memory the estimate is monotone in cp; states never grow."""
    shape = shape_from_hf_config(config)
    for tp in (1, 2):
        one = layer_activation_bytes(shape, seq_len=8192, micro_batch=1, tp=tp, dtype="bf16", flash_attention=flash)
        for cp in (c for c in (2, 4, 8) if config.num_attention_heads % (tp * c) == 0):  # heads split by cp
            split = layer_activation_bytes(
                shape, seq_len=8192, micro_batch=1, tp=tp, dtype="bf16", flash_attention=flash, cp=cp
            )
            if config.num_key_value_heads % (tp * cp) == 0 or not flash:  # eager keeps k, v repeated to a heads
                assert split == pytest.approx(one / cp)
            else:
                assert one / cp < split < one
    previous = None
    for cp in (1, 2, 4, 8):
        est = estimate(shape, Setup(dp=1, cp=cp, pp=2 if config.num_hidden_layers >= 4 else 1, seq_len=8192, flash_attention=flash))
        if previous is not None:
            assert est.activations_gb < previous.activations_gb
            assert est.total_gb < previous.total_gb
            assert est.model_states_gb <= previous.model_states_gb + 1e-12
            assert est.comm_bytes["cp"] > 0
        previous = est


def _estimate_json(capsys, *argv):
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_cp_on_a_recipe(capsys, tmp_path):
    """`--cp` overrides the recipe; dp "auto" refills the cluster (world 16 = dp 2 x cp 2 x tp 2 x pp 2)."""
    base = _estimate_json(capsys, "recipes/llama3-8b-2x8.yaml")
    split = _estimate_json(capsys, "recipes/llama3-8b-2x8.yaml", "--cp", "2")
    assert (base["setup"]["dp"], base["setup"]["cp"]) == (4, 1)
    assert (split["setup"]["dp"], split["setup"]["cp"]) == (2, 2)
    assert split["activations_gb"] < base["activations_gb"]
    assert split["comm_bytes"]["cp"] > 0 and base["comm_bytes"]["cp"] == 0
    tiled = _estimate_json(capsys, "recipes/llama3-8b-2x8.yaml", "--loss-tile-tokens", "512")
    assert tiled["stages"][-1]["activations_gb"] < base["stages"][-1]["activations_gb"]
    assert main(["estimate", "recipes/llama3-8b-2x8.yaml", "--cp", "2"]) == 0
    assert "x cp 2 x" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["recipes/llama3-8b-2x8.yaml", "--cp", "2", "--seq-len", "4095"], "--cp = 2"),  # does not divide seq_len
        (["recipes/llama3-8b-2x8.yaml", "--cp", "8"], "parallel.dp"),  # 2 x 2 x 8 does not divide 16 ranks
        (["--params", "1B", "--dp", "2", "--ep", "2", "--cp", "2"], "--cp = 2"),
    ],
)
def test_cli_cp_refusals(capsys, argv, flag):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
