"""The estimator: published figures, formulas, the per-stage split, and the CLI. No processes."""

from __future__ import annotations

import json

import pytest
from transformers import GemmaConfig, LlamaConfig, MixtralConfig

from dsx3d.cli import main
from dsx3d.estimate import (
    Hardware,
    ModelShape,
    ParamCount,
    Setup,
    bubble_fraction,
    estimate,
    layer_activation_bytes,
    model_state_bytes,
    shape_from_hf_config,
    shape_from_params,
    split_layers,
)
from dsx3d.pipeline.split import decoder_split

TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)


# Gemma-2B's dimensions (18 layers, hidden 2048, MQA, 256k vocabulary)
GEMMA_2B = dict(
    hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
    head_dim=256, vocab_size=256000,
)


def _tiny(**overrides):
    return shape_from_hf_config(LlamaConfig(**{**TINY, **overrides}))


@pytest.mark.parametrize(("stage", "paper_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, paper_gb):
    """ZeRO (Rajbhandari et al. 2020) Fig. 1: 7.5B parameters, Nd = 64, K = 12."""
    states = model_state_bytes(7.5e9, dp=64, zero_stage=stage, dtype="bf16")
    assert round(states.total / 1e9, 1) == paper_gb
    # the paper's model has no fp32 gradient buffer (dsx3d's bf16 + ZeRO >= 1 config does: counted by default)
    est = estimate(shape_from_params(7.5e9), Setup(dp=64, zero_stage=stage, fp32_grad_accum=False))
    assert round(est.model_states_gb, 1) == paper_gb


def test_zero_exact_terms():
    """(2 + 2 + K) * N, sharded stage by stage: 4N + 12N/d, 2N + 14N/d, 16N/d."""
    n, d = 7.5e9, 64
    assert model_state_bytes(n, dp=d, zero_stage=1).total == pytest.approx(4 * n + 12 * n / d)
    assert model_state_bytes(n, dp=d, zero_stage=2).total == pytest.approx(2 * n + 14 * n / d)
    assert model_state_bytes(n, dp=d, zero_stage=3).total == pytest.approx(16 * n / d)


def test_fp32_states():
    """fp32: 4 + 4 + 8 bytes without ZeRO; with ZeRO-1 DeepSpeed's own fp32 partition makes K = 12."""
    assert model_state_bytes(1e9, dp=4, zero_stage=0, dtype="fp32").total == pytest.approx(16e9)
    assert model_state_bytes(1e9, dp=4, zero_stage=1, dtype="fp32").total == pytest.approx(8e9 + 12e9 / 4)


def test_bubble_formula_and_step_time():
    """(p-1)/(m+p-1), and a balanced pipeline's step is the 1-device time / p / (1 - bubble)."""
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(1, 7) == 0.0
    shape = shape_from_params(8e9, num_layers=32)
    one = estimate(shape, Setup(dp=1, pp=1, grad_accum=12))
    four = estimate(shape, Setup(dp=1, pp=4, grad_accum=12))
    assert four.bubble_fraction == pytest.approx(3 / 15)
    assert four.step_time_s * (1 - four.bubble_fraction) * 4 == pytest.approx(one.step_time_s)


def test_bubble_matches_layout():
    from dsx3d.plan.layout import bubble_fraction as layout_bubble

    for p, m in [(2, 1), (4, 8), (8, 32)]:
        assert bubble_fraction(p, m) == layout_bubble(p, m)


def test_param_counts_match_hf_models():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    for config in (
        LlamaConfig(**TINY),
        LlamaConfig(**TINY, tie_word_embeddings=True),
        MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    ):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert shape_from_hf_config(config).total_params == sum(p.numel() for p in model.parameters())


def test_embedding_on_first_stage_head_on_last():
    shape = _tiny()
    est = estimate(shape, Setup(pp=4, split="even"))
    layer, vocab = shape.layer.total, shape.vocab_size * shape.hidden_size
    assert [st.layers for st in est.stages] == [2, 2, 2, 2]
    assert est.stages[0].params == 2 * layer + vocab
    assert est.stages[1].params == est.stages[2].params == 2 * layer
    assert est.stages[3].params == 2 * layer + vocab + shape.hidden_size


def test_tied_embedding_counted_on_both_ends():
    shape = _tiny(tie_word_embeddings=True)
    vocab = shape.vocab_size * shape.hidden_size
    piped = estimate(shape, Setup(pp=2))
    assert sum(st.params for st in piped.stages) == shape.total_params + vocab
    single = estimate(shape, Setup(pp=1))
    assert single.stages[0].params == shape.total_params
    assert piped.comm_bytes["tied"] > 0


def test_splits():
    assert split_layers(30, 4) == [7, 8, 8, 7]
    assert split_layers(32, 1) == [32]
    # a head worth 2.4 layers leaves the last stage 6 layers and balances the rest
    assert decoder_split(_costed(32, 1.0, 2.4), 4, 1) == [8, 9, 9, 6]
    assert sum(decoder_split(_costed(80, 1.0, 1.2), 8, 1)) == 80
    # a head heavier than a stage's share of layers still shares its stage with one decoder layer
    assert decoder_split(_costed(12, 1.0, 5.0), 4, 1) == [3, 4, 4, 1]


def _costed(num_layers: int, layer: float, head: float) -> ModelShape:
    """A shape whose decoder layer costs `layer` and whose head costs `head` (attention-free)."""
    return ModelShape(num_layers=num_layers, layer=ParamCount(sharded=1), layer_flop_params=int(10 * layer), head=int(10 * head))


def test_split_matches_the_engine_for_every_family():
    """The estimator's default split is the one dsx3d's pipeline builds, for every family with plans, so
    per-stage memory is estimated for the split that runs. (The engine and the estimator once read the model
    separately and split a Gemma-2B-shaped model [6, 6, 6, 0] and [5, 6, 6, 1].)"""
    from dsx3d.models.known_families import families_with_plans, refusal, tiny_config
    from dsx3d.pipeline.module import stage_bounds

    checked = 0
    configs = [("gemma-2b-shape", GemmaConfig(**GEMMA_2B))] + [
        (f, tiny_config(f, num_hidden_layers=8)) for f in families_with_plans() if refusal(f, 1) is None
    ]
    for name, config in configs:
        try:
            shape = shape_from_hf_config(config)
        except Exception:
            continue  # heterogeneous configs: the estimator refuses them, the engine splits evenly
        layers = shape.num_layers
        for pp, seq_len in [(2, 16), (4, 4096)]:
            bounds = stage_bounds(config, pp, seq_len, None)  # over [embedding, layers, norm, head]
            engine = [len(set(range(a, b)) & set(range(1, layers + 1))) for a, b in zip(bounds[:-1], bounds[1:])]
            est = estimate(shape, Setup(pp=pp, seq_len=seq_len))
            assert [st.layers for st in est.stages] == engine, (name, pp, seq_len)
            checked += 1
    assert checked > 100


def test_korthikanti_activations():
    """s*b*h*(34 + 5*a*s/h) per layer in 16-bit; with TP t: s*b*h*(10 + 24/t + 5*a*s/(h*t))."""
    shape = shape_from_params(1e9, num_layers=16, hidden_size=2048, num_heads=16)
    s, b, h, a = 1024, 2, 2048, 16
    got = layer_activation_bytes(shape, seq_len=s, micro_batch=b, tp=1, dtype="bf16")
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    got = layer_activation_bytes(shape, seq_len=s, micro_batch=b, tp=4, dtype="bf16")
    assert got == pytest.approx(s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    flash = layer_activation_bytes(shape, seq_len=s, micro_batch=b, tp=1, dtype="bf16", flash_attention=True)
    assert flash == pytest.approx(34 * s * b * h)


def test_checkpointing_lowers_activations_and_costs_time():
    shape = _tiny()
    plain = estimate(shape, Setup(pp=2, grad_accum=8, seq_len=256))
    ckpt = estimate(shape, Setup(pp=2, grad_accum=8, seq_len=256, activation_checkpointing=True))
    for a, c in zip(plain.stages, ckpt.stages):
        assert c.activations_gb < a.activations_gb
        assert c.model_states_gb == a.model_states_gb
    assert ckpt.step_time_s > plain.step_time_s


def test_first_stage_holds_pp_micro_batches():
    """1F1B: stage i keeps min(pp - i, m) micro-batches in flight."""
    shape = shape_from_params(1e9, num_layers=8, hidden_size=1024)
    for m, expected in [(8, [4, 3, 2, 1]), (2, [2, 2, 2, 1])]:
        est = estimate(shape, Setup(pp=4, grad_accum=m))
        per_layer = est.stages[1].activations_gb / expected[1]
        assert [round(st.activations_gb / per_layer) for st in est.stages] == expected


def test_dp_traffic_follows_zero_stage():
    """ZeRO-1 sends 1.5x DDP (all-reduce + all-gather); ZeRO-2 reduce-scatters every micro-batch."""
    shape = shape_from_params(1e9)
    bytes_for = {
        z: estimate(shape, Setup(dp=8, zero_stage=z, grad_accum=4, fp32_grad_accum=False)).comm_bytes["dp"]
        for z in range(4)
    }
    ddp = 2 * 7 / 8 * 2e9
    assert bytes_for[0] == pytest.approx(ddp)
    assert bytes_for[1] == pytest.approx(1.5 * ddp)
    assert bytes_for[2] == pytest.approx((4 + 1) * 7 / 8 * 2e9)
    assert bytes_for[3] == pytest.approx(3 * 4 * 7 / 8 * 2e9)


def test_overflow_flagged():
    est = estimate(shape_from_params(7.5e9), Setup(dp=1, zero_stage=0), Hardware(gpu_memory_gb=80))
    # ZeRO-0: 120 GB of states, and the peak adds the optimizer step's temporaries on top
    assert est.model_states_gb == pytest.approx(120) and est.total_gb > est.model_states_gb
    assert est.fits is False and est.overflow_gb() == pytest.approx(est.total_gb - 72)


def test_cli_json_is_one_object(capsys):
    rc = main(["estimate", "--params", "7.5e9", "--dp", "64", "--zero-stage", "2", "--no-fp32-grad-accum", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert round(data["model_states_gb"], 1) == 16.6
    for key in ("activations_gb", "total_gb", "step_time_s", "bubble_fraction", "mfu", "stages"):
        assert key in data
    assert data["stages"][0]["total_gb"] == data["total_gb"]


def test_cli_recipe(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model:\n  config: {model_type: llama, hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 4,"
        " num_key_value_heads: 2, intermediate_size: 128, vocab_size: 2048}\n"
        "parallel: {tp: 2, pp: 2}\ncluster: {nodes: 1, gpus_per_node: 8}\n"
        "train: {micro_batch_size: 2, gradient_accumulation_steps: 4, seq_len: 64}\n"
    )
    assert main(["estimate", str(recipe), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["dp"] == 2 and len(data["stages"]) == 2
    assert main(["estimate", str(recipe)]) == 0
    assert "stage" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate"],
        ["estimate", "--params", "1e9", "--pp", "2"],
        ["estimate", "--params", "1e9", "--pp", "2", "--layers", "1"],
        ["estimate", "--params", "1e9", "--pp", "2", "--layers", "4", "--zero-stage", "3"],
        ["estimate", "no-such-recipe.yaml"],
    ],
)
def test_cli_bad_input_exits_2(argv, capsys):
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_recipe_setup_reads_the_degrees_record(tmp_path, monkeypatch):
    """The recipe -> estimate mapping takes dp, tp, pp, cp, ep and the virtual stages from `Recipe.degrees()`."""
    import argparse
    from dataclasses import replace as dc_replace

    from dsx3d.cli import cmd_estimate
    from dsx3d.plan.degrees import Degrees
    from dsx3d.recipe.schema import Recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model:\n  config: {model_type: llama, hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 4,"
        " num_key_value_heads: 2, intermediate_size: 128, vocab_size: 2048}\n"
        "parallel: {tp: 2, pp: 2}\ncluster: {nodes: 1, gpus_per_node: 8}\n"
        "train: {micro_batch_size: 2, gradient_accumulation_steps: 4, seq_len: 64}\n"
    )
    args = argparse.Namespace(recipe=str(recipe), params=None, dp=None, tp=None, pp=None, cp=None)
    _, setup, _ = cmd_estimate._from_recipe(args)
    assert setup.degrees == Degrees(dp=2, tp=2, pp=2)
    seen = []
    original = Recipe.degrees

    def spy(self, world_size=None):
        seen.append(world_size)
        return dc_replace(original(self, world_size), virtual_stages=2)

    monkeypatch.setattr(Recipe, "degrees", spy)
    _, setup, _ = cmd_estimate._from_recipe(args)
    assert seen and setup.virtual_stages == 2
    _, setup, _ = cmd_estimate._from_recipe(argparse.Namespace(**{**vars(args), "tp": 1}))
    assert setup.dp == 4  # parallel.dp "auto" over the overridden degrees: 8 / (1 x 2)
