"""Pipeline stages without decoder layers: the default split never makes one, and an explicit
`parallel.stage_layers` that asks for one (first stage: only the embedding; last stage: only the final norm
and the head) trains in bf16 and fp32 like the single-process reference, on forked gloo ranks.

With tied embeddings and tp 2, the last stage's TP rank 1 counts no gradient in the global norm (the norm
is replicated, the head is a tied copy); DeepSpeed's bf16 optimizer then stacked an empty list.
"""

from __future__ import annotations

import os

import pytest
from transformers import AutoConfig, PretrainedConfig

from dsx3d.models.known_families import families_with_plans, tiny_config
from dsx3d.pipeline.split import stage_layers_for
from dsx3d.verify.parity import ParityCase, ParityResult, run_parity

pytestmark = pytest.mark.usefixtures("warm")


def qwen2_large_vocab(vocab_size: int = 32000, layers: int = 4) -> PretrainedConfig:
    """A small Qwen2 with a large tied vocabulary: the head outweighs all its decoder layers."""
    return AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )


def _assert_tracks(r: ParityResult, names: tuple[str, ...]) -> None:
    checks = {c.name: c for c in r.checks}
    assert all(checks[n].ok for n in names), r.to_dict()
    assert r.losses_3d[0] != r.losses_3d[-1], r.to_dict()  # the run trained


# -- the default split ----------------------------------------------------------------------------------------


# Qwen2.5-0.5B's dimensions: a 151936-token tied head outweighs a quarter of its 24 layers
QWEN25_05B = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    ("config", "pp", "expected"),
    [
        (qwen2_large_vocab(), 2, [3, 1]),  # the cost optimum alone is [4, 0]
        (AutoConfig.for_model("qwen2", **QWEN25_05B), 4, [7, 8, 8, 1]),  # alone [8, 8, 8, 0]
        (qwen2_large_vocab(151936, layers=8), 4, [2, 2, 3, 1]),  # alone [2, 3, 3, 0]
    ],
    ids=["qwen2-h64-v32000-pp2", "qwen2.5-0.5b-pp4", "qwen2-h64-v151936-pp4"],
)
def test_default_split_gives_every_stage_a_decoder_layer(config: PretrainedConfig, pp: int, expected: list[int]) -> None:
    assert stage_layers_for(config, pp, 2048, None) == expected


FAMILIES = families_with_plans()
SAMPLE = FAMILIES if os.environ.get("DSX3D_SWEEP") == "1" else FAMILIES[::12]  # CI: a sample; all: opt-in


@pytest.mark.parametrize("family", SAMPLE)
def test_every_stage_has_a_layer_for_any_vocabulary(family: str) -> None:
    """HF families with pipeline and TP plans (a CI sample, all with DSX3D_SWEEP=1), their tiny vocabulary
    and Gemma's 256k, every pp up to the layer count."""
    for vocab in (None, 256000):
        config = tiny_config(family, num_hidden_layers=6, **({} if vocab is None else {"vocab_size": vocab}))
        [layers] = stage_layers_for(config, 1, 512, None)  # the decoder layers the pipeline builds
        for pp in range(1, layers + 1):
            split = stage_layers_for(config, pp, 512, None)
            assert len(split) == pp and sum(split) == layers and min(split) >= 1, (family, vocab, pp, split)


# -- training a stage without layers against the reference --------------------------------------------------


@pytest.mark.parametrize("zero_stage", ([0] if os.environ.get("DSX3D_SWEEP") else []) + [1])
def test_bf16_last_stage_with_only_the_tied_head(zero_stage: int) -> None:
    """[4, 0] at tp 2 in bf16: the optimizer step runs and loss and gradient norm follow the fp32 reference
    within bf16's tolerance (dsx3d.verify.parity.CRITERIA)."""
    case = ParityCase(
        qwen2_large_vocab(), dp=1, tp=2, pp=2, stage_layers=[4, 0], dtype="bf16", zero_stage=zero_stage, steps=2
    )
    _assert_tracks(run_parity(case), ("loss", "grad_norm"))


def test_fp32_first_stage_with_only_the_embedding() -> None:
    """[0, 4] in fp32: the first stage is the embedding alone; losses and weights match the reference."""
    case = ParityCase(qwen2_large_vocab(2048), dp=1, tp=2, pp=2, stage_layers=[0, 4], steps=2)
    _assert_tracks(run_parity(case), ("loss", "weights"))


def test_pp4_large_vocabulary_bf16() -> None:
    """A 151936-token tied head at pp 4 (the default split, every stage with a layer) trains in bf16."""
    case = ParityCase(qwen2_large_vocab(151936), dp=1, tp=1, pp=4, dtype="bf16", steps=2, micro_batches=4)
    _assert_tracks(run_parity(case), ("loss", "grad_norm"))
