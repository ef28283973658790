"""Context parallelism on the command line and through accelerate's layout source: `--cp` on plan, check and
config (errors exit 2 naming the flag), the plan's CP groups, its warning for a CP group across nodes, its
drawing, and the "dsx3d" section of a generated DeepSpeed JSON turning back into the same layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dsx3d.checks import check_recipe
from dsx3d.cli import main
from dsx3d.integrations.layout_source import recipe_from_ds_config
from dsx3d.recipe.ds_config import build_ds_config
from dsx3d.recipe.schema import recipe_from_dict

LONG = "recipes/qwen3-0.6b-32k-cp.yaml"


def _plan_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_flags_show_cp_groups(capsys):
    data = _plan_json(capsys, "--world-size", "16", "--gpus-per-node", "8", "--tp", "2", "--pp", "2", "--cp", "2")
    assert (data["dp"], data["cp"], data["tp"], data["pp"]) == (2, 2, 2, 2)
    assert data["cp_groups"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert data["data_groups"][0] == [0, 2, 4, 6]
    assert data["cross_node"]["cp_groups"] == [] and data["warnings"] == []
    assert main(["plan", "--world-size", "16", "--gpus-per-node", "8", "--tp", "2", "--pp", "2", "--cp", "2"]) == 0
    text = capsys.readouterr().out
    assert "world 16 = dp 2 x cp 2 x tp 2 x pp 2" in text
    assert "CP groups (one sequence split, all-to-all around attention) (all inside a node): [0,2] [1,3]" in text


def test_plan_warns_when_a_cp_group_crosses_nodes(capsys):
    data = _plan_json(capsys, "--world-size", "16", "--gpus-per-node", "4", "--tp", "2", "--pp", "2", "--cp", "4")
    assert data["cross_node"]["cp_groups"] == data["cp_groups"]
    assert len(data["warnings"]) == 1 and "--cp = 4: CP groups cross nodes" in data["warnings"][0]
    inside = _plan_json(capsys, "--world-size", "16", "--gpus-per-node", "8", "--tp", "2", "--pp", "2", "--cp", "4")
    assert inside["warnings"] == []  # cp x tp = 8 fills a node exactly


def test_plan_recipe_with_cp_override(capsys, tmp_path):
    data = _plan_json(capsys, LONG)
    assert (data["dp"], data["cp"], data["tp"]) == (1, 4, 2)
    cp2 = _plan_json(capsys, LONG, "--cp", "2")
    assert (cp2["dp"], cp2["cp"]) == (2, 2)  # dp "auto" refills the 8 ranks
    across = _plan_json(capsys, LONG, "--gpus-per-node", "4", "--world-size", "8")
    assert any(w.startswith("warning: parallel.cp = 4: CP groups cross nodes") for w in across["warnings"])
    svg = tmp_path / "plan.svg"
    assert main(["plan", LONG, "--svg", str(svg)]) == 0
    drawing = svg.read_text()
    assert "CP groups (sequence split)" in drawing and "x cp 4 x" in drawing


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["plan", "--world-size", "8", "--tp", "2", "--pp", "1", "--cp", "3"], "--world-size = 8"),
        (["plan", "--world-size", "8", "--tp", "1", "--pp", "1", "--cp", "2", "--ep", "2"], "--cp = 2"),
        (["plan", LONG, "--cp", "3"], "parallel.dp"),
        (["check", LONG, "--cp", "3"], "parallel.dp"),
        (["config", LONG, "--cp", "3", "-o", "unused.json"], "parallel.dp"),
    ],
)
def test_cp_errors_exit_2_naming_the_key(capsys, argv, key):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert key in captured.err + captured.out and "Traceback" not in captured.err
    assert "cp" in captured.err + captured.out


@pytest.mark.parametrize("command", ["plan", "check", "config", "estimate"])
def test_cp_flag_bounds(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, LONG, "--cp", "0"])
    assert exit_info.value.code == 2
    assert "--cp" in capsys.readouterr().err


def test_check_and_config_take_cp(capsys, tmp_path):
    assert main(["check", LONG, "--cp", "2"]) == 0
    out = tmp_path / "ds.json"
    assert main(["config", LONG, "--cp", "2", "-o", str(out)]) == 0
    section = json.loads(out.read_text())["dsx3d"]
    assert (section["dp"], section["cp"], section["tp"], section["world_size"]) == (2, 2, 2, 8)


@pytest.mark.parametrize(("dp", "cp", "tp", "pp"), [(1, 2, 1, 1), (2, 2, 2, 1), (1, 4, 2, 1), (2, 2, 1, 2)])
def test_ds_config_section_carries_cp_back(dp, cp, tp, pp):
    """accelerate's layout source: a generated JSON turns back into a recipe with the same cp (and the same JSON)."""
    world = dp * cp * tp * pp
    data = {
        "model": {"config": {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 8}},
        "parallel": {"dp": "auto", "tp": tp, "pp": pp, "cp": cp},
        "cluster": {"nodes": 1, "gpus_per_node": world},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 4, "seq_len": 64, "dtype": "fp32"},
    }
    config = build_ds_config(recipe_from_dict(data), world)
    assert config["train_batch_size"] == 4 * dp * cp
    back = recipe_from_ds_config(config, "ds.json", data["model"])
    assert (back.parallel.cp, back.resolved_dp(world)) == (cp, dp)
    assert build_ds_config(back, world) == config
    # the checker takes it back as it wrote it: DeepSpeed's batch arithmetic counts dp x cp data ranks
    errors = [p for p in check_recipe(back, world_size=world, data=False) if p.severity == "error"]
    assert not errors, errors


def test_train_batch_size_is_counted_over_dp_x_cp():
    data = {
        "model": {"config": {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 8}},
        "parallel": {"dp": 2, "tp": 1, "pp": 2, "cp": 2},
        "cluster": {"nodes": 1, "gpus_per_node": 8},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 4, "seq_len": 64, "dtype": "fp32"},
    }
    ok = recipe_from_dict({**data, "deepspeed": {"train_batch_size": 16}})
    assert not [p for p in check_recipe(ok, world_size=8, data=False) if p.key == "deepspeed.train_batch_size"]
    wrong = recipe_from_dict({**data, "deepspeed": {"train_batch_size": 8}})  # dp alone
    (problem,) = [p for p in check_recipe(wrong, world_size=8, data=False) if p.key == "deepspeed.train_batch_size"]
    assert "1 x 4 x 4" in problem.reason and "dp x cp = 4" in problem.reason, problem


def test_long_recipe_golden_config_and_layout():
    recipe_path = Path(LONG)
    data = yaml.safe_load(recipe_path.read_text())
    assert data["train"]["seq_len"] == 32768 and data["parallel"]["cp"] > 1
    golden = json.loads(Path("ds_configs/qwen3-0.6b-32k-cp.json").read_text())
    assert golden == build_ds_config(recipe_from_dict(data, source=str(recipe_path)), 8)
