"""bf16 verify on a generated config whose shadow's gradient-norm round-off cancelled by chance: under TP the
3D side's norm differs from fp32 by 5e-4 of itself (per-tensor gradients as close as the shadow's), while
the shadow's per-tensor shares of the norm, each about that size, summed to 4e-6. The allowance must come
from the shares, not from their lucky sum (dsx3d.verify.bf16_roundoff.norm_roundoff); every step is compared
from the parallel run's own weights, so the second step holds no first-step difference.

And the applied-norm check (dsx3d.verify.clip_check) on one rank: the squares an fp32 norm swamps (an untied
vocabulary of 32000), and the fp32 masters of the fp16 wrapper that drives bf16 without ZeRO
(dsx3d.verify.master_weights)."""

from __future__ import annotations

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.parity import SGD_LR, ParityCase, run_parity
from dsx3d.verify.sweep import sweep_cases


def test_bf16_norm_allowance_does_not_rest_on_a_cancelled_draw() -> None:
    case = sweep_cases(16, seed=0)[7]  # cwm, 6 heads over 2 kv heads, untied vocabulary of 127
    assert case.family == "cwm" and case.dtype == "bf16"
    parity = ParityCase(
        case.config(), dp=2, tp=2, pp=1, zero_stage=1, steps=2, dtype="bf16", optimizer="sgd", lr=SGD_LR
    )
    result = run_parity(parity)
    norm = next(c for c in result.checks if c.name == "grad_norm")
    assert abs(result.grad_norms_3d[0] - result.grad_norms_ref[0]) > 1e-4  # the TP side's own draw
    assert result.ok, [vars(c) for c in result.checks]
    assert norm.worst < 0.9


def _applied_norm(parity: ParityCase) -> float:
    result = run_parity(parity)
    assert result.ok, [vars(c) for c in result.checks]
    return next(c.worst for c in result.checks if c.name == "applied_norm")


def test_a_vocabulary_head_whose_fp32_norm_swamps_its_small_squares_passes() -> None:
    """A generated gpt_neox with an untied 32000 x 32 head, one rank, ZeRO-1 (BF16_Optimizer): at step 2 the
    engine's fp32 norm of the head lost 7.9e-4 of its square to swamping, the update came out 3.4e-4 longer
    than the reported norm, 3.75 times the sum's random rounding."""
    dims = {"attention_bias": True, "head_dim": 8, "hidden_size": 32, "intermediate_size": 136}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 4}
    config = tiny_config("gpt_neox", tie_word_embeddings=False, vocab_size=32000, **dims, **heads)
    parity = ParityCase(config, zero_stage=1, steps=2, dtype="bf16", optimizer="sgd", lr=SGD_LR)
    assert _applied_norm(parity) < 0.5


def test_masters_of_the_fp16_wrapper_driving_bf16_without_zero_are_read() -> None:
    """bf16 at ZeRO-0 on the regular engine runs FP16_UnfusedOptimizer, whose fp32 copies
    safe_get_full_fp32_param does not find: read from the bf16 parameters instead, the update carried their
    2^-8 rounding and applied_norm failed 7.6 times over on the tiny llama."""
    parity = ParityCase(tiny_config("llama"), zero_stage=0, steps=2, dtype="bf16", optimizer="sgd", lr=SGD_LR)
    assert _applied_norm(parity) < 0.1


def test_adamw_at_zero0_counts_its_steps_as_hf_does() -> None:
    """bf16 at ZeRO-0 on the regular engine: FP16_UnfusedOptimizer's constructor stepped AdamW once on zero
    gradients, so every element with a solid gradient moved 0.735 lr at the first step instead of lr
    (the qkv bias of the untied gpt_neox: weights 6.5 times over); dsx3d.engine.fp16_wrapper_state."""
    dims = {"attention_bias": True, "head_dim": 8, "hidden_size": 32, "intermediate_size": 136}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 4}
    config = tiny_config("gpt_neox", tie_word_embeddings=False, vocab_size=32000, **dims, **heads)
    result = run_parity(ParityCase(config, zero_stage=0, steps=2, dtype="bf16"))
    assert result.ok, [vars(c) for c in result.checks]
    assert next(c.worst for c in result.checks if c.name == "weights") < 0.8
