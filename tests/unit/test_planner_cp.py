"""The layout planner with context parallelism: the search space (cp next to tp inside a node, heads split,
long sequences only) and the choice for a 0.5B-class model at 32k tokens."""

from __future__ import annotations

import json

import pytest

from dsx3d.checks import check_recipe
from dsx3d.cli import main
from dsx3d.estimate import Setup, shape_from_hf_config
from dsx3d.planner.search import LONG_SEQ, Cluster, enumerate_setups, plan_layouts, recipe_for
from dsx3d.recipe.hf_config import load_hf_config
from dsx3d.recipe.schema import ModelSection, load_recipe

# Qwen3-0.6B's dimensions: 16 heads, 8 KV heads (cp up to 8 with tp 1, 4 with tp 2)
QWEN3_06B = {
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": True, "max_position_embeddings": 40960,
}  # fmt: skip
# Qwen2.5-0.5B's: 14 heads, so a TP rank's heads split over cp 2 only (and cp 7, which no node of 8 holds)
QWEN25_05B = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip


def _shape(config: dict):
    model = ModelSection(config=config)
    hf_config = load_hf_config(model)
    return shape_from_hf_config(hf_config), model, hf_config


@pytest.mark.parametrize("config", [QWEN3_06B, QWEN25_05B], ids=["qwen3-0.6b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("gpus_per_node", [4, 8])
def test_search_space(config, gpus_per_node):
    shape, _, _ = _shape(config)
    cluster = Cluster(2, gpus_per_node, 80)
    setups, skipped = enumerate_setups(shape, cluster, global_batch=16, seq_len=32768)
    cps = {s.cp for s in setups}
    assert cps - {1}, "a long sequence is tried with cp > 1"
    for s in setups:
        assert s.world_size == cluster.world_size
        assert gpus_per_node % (s.cp * s.tp) == 0  # CP next to TP inside a node
        assert config["num_attention_heads"] % (s.tp * s.cp) == 0
        assert 32768 % (s.tp * s.cp) == 0
        assert s.ep == 1 or s.cp == 1
    if config is QWEN25_05B:
        assert cps == {1, 2}
        assert any("14 attention heads do not split" in note for note in skipped)
    short, _ = enumerate_setups(shape, cluster, global_batch=16, seq_len=LONG_SEQ // 2)
    assert {s.cp for s in short} == {1}
    only, _ = enumerate_setups(shape, cluster, global_batch=16, seq_len=LONG_SEQ // 2, cps=(2,))
    assert {s.cp for s in only} == {2}


def test_planner_picks_cp_for_32k_tokens():
    """Qwen3-0.6B at 32768 tokens on one node of 8 x 80 GB: the choice splits the sequence, and the fastest
    layout without cp (tp 8 fits too: it splits the logits as well) is slower."""
    shape, model, hf_config = _shape(QWEN3_06B)
    base = Setup(flash_attention=True)
    result = plan_layouts(shape, Cluster(1, 8, 80), global_batch=8, seq_len=32768, base=base, model=model,
                          hf_config=hf_config)  # fmt: skip
    best = result.best
    assert best is not None and best.setup.cp > 1
    assert not [p for p in check_recipe(recipe_for(best.setup, Cluster(1, 8, 80), model), hf_config=hf_config)
                if p.severity == "error"]  # fmt: skip
    no_cp = [c for c in result.ranked if c.setup.cp == 1]
    assert no_cp and no_cp[0].estimate.tokens_per_s < best.estimate.tokens_per_s
    chosen = next(g for g in result.groups if g.status == "chosen")
    assert chosen.cp == best.setup.cp and f"cp{chosen.cp}" in chosen.label()


def test_tiled_loss_makes_qwen25_fit_at_32k():
    """Qwen2.5-0.5B (14 heads: tp <= 2, cp <= 2) at 32768 tokens on 48 GB devices: its whole logits (18 bytes x
    16384 tokens x 151936 on a cp 2 rank) do not fit anywhere; with the tiled loss the planner finds cp 2."""
    shape, model, hf_config = _shape(QWEN25_05B)
    whole = plan_layouts(shape, Cluster(1, 8, 48), global_batch=8, seq_len=32768, base=Setup(flash_attention=True),
                         use_checker=False)  # fmt: skip
    assert whole.best is None
    tiled = plan_layouts(shape, Cluster(1, 8, 48), global_batch=8, seq_len=32768,
                         base=Setup(flash_attention=True, loss_tile_tokens=2048), use_checker=False)  # fmt: skip
    assert tiled.best is not None and tiled.best.setup.cp == 2


def test_cli_auto_with_cp(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_06B))
    out = tmp_path / "chosen.yaml"
    argv = ["plan", "--auto", "--model", str(config), "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "40",
            "--global-batch", "8", "--seq-len", "32768", "--flash-attention", "--top", "3"]  # fmt: skip
    assert main([*argv, "--json", "--write-recipe", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["setup"]["cp"] > 1
    assert {g["cp"] for g in data["groups"]} >= {1, 2, 4}
    assert load_recipe(out).parallel.cp == data["chosen"]["setup"]["cp"]
    assert main([*argv, "--cp", "2"]) == 0
    text = capsys.readouterr().out
    assert "chosen: dp4 cp2 tp1" in text or "chosen: dp" in text and " cp2 " in text
    assert " cp4 " not in text.split("why the other")[0]
