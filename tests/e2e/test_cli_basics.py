"""`dsx3d plan`, `check` and `config`, run in-process through `dsx3d.cli.main`: exit codes and outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dsx3d.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-llama-3d.yaml"
REFERENCE_FLAGS = ["plan", "--world-size", "16", "--gpus-per-node", "8", "--tp", "2", "--pp", "4"]


def _write_recipe(tmp_path: Path, **sections: dict) -> Path:
    data = yaml.safe_load(TINY.read_text())
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_recipe_prints_table_and_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(TINY)]) == 0
    out = capsys.readouterr().out
    assert "rank  node local_rank" in out and "TP groups (all inside a node): [0,1] [2,3]" in out
    assert "bubble with m = 4 micro-batches" in out and "20.0%" in out
    assert "tied embedding" not in out  # the tiny Llama unties embedding and head


@pytest.mark.parametrize(
    "schedule, layers, held", [("zb-v", [1, 1, 1, 1], "r and 3 - r"), ("interleaved-1f1b", [1, 1, 1, 1], "r, r + 2"), ("1f1b", [3, 1], None)]
)
def test_plan_recipe_with_another_schedule_shows_its_split(
    schedule: str, layers: list[int], held: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--schedule` on a recipe of 1f1b: the checker and the split see the schedule with the chunks it runs."""
    assert main(["plan", str(TINY), "--schedule", schedule, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["schedule"], data["stage_layers"]) == (schedule, layers)
    assert main(["plan", str(TINY), "--schedule", schedule]) == 0
    out = capsys.readouterr().out
    assert (f"rank r holds stages {held}" in out) if held else "virtual stages" not in out
    assert main(["plan", str(TINY), "--schedule", schedule, "--pp", "1", "--dp", "4"]) == (0 if schedule == "1f1b" else 2)


def _interleaved_v3_recipe(tmp_path: Path) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["model"]["config"]["num_hidden_layers"] = 6
    data["parallel"].update(schedule="interleaved-1f1b", virtual_stages=3)
    path = tmp_path / "v3.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("schedule, chunks", [("interleaved-1f1b", 3), ("zb-v", 2), ("1f1b", 1)])
def test_plan_and_estimate_schedule_keep_a_looped_recipes_chunks(
    schedule: str, chunks: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On an interleaved recipe of 3 chunks, `--schedule` keeps 3 for a schedule of any chunk count and gives a
    fixed-count schedule its own (zb-v: the V's two; they were 3, refused by zb-v's checker, and estimate
    forced 2 on interleaved-1f1b), in both commands."""
    recipe = _interleaved_v3_recipe(tmp_path)
    assert main(["plan", str(recipe), "--schedule", schedule, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["stage_layers"]) == 2 * chunks
    assert main(["estimate", str(recipe), "--schedule", schedule, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["virtual_stages"] == chunks
    assert main(["estimate", "--params", "1B", "--layers", "8", "--pp", "2", "--schedule", schedule, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["virtual_stages"] == min(chunks, 2)  # no recipe: its own


def test_plan_json_is_exactly_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*REFERENCE_FLAGS, "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # fails on anything but one JSON document
    assert out.strip().count("\n") == 0
    assert (data["world_size"], data["dp"], data["tp"], data["pp"], data["gpus_per_node"]) == (16, 2, 2, 4, 8)
    assert data["pp_groups"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert data["ranks"][9] == {"rank": 9, "node": 1, "local_rank": 1, "pp": 2, "dp": 0, "tp": 1, "cp": 0}
    assert data["cross_node"]["tp_groups"] == [] and data["cross_node"]["dp_groups"] == []
    assert data["pp_node_crossings"] == [[1, 2]]
    assert data["tied_groups"] == [[0, 12], [1, 13], [2, 14], [3, 15]] and data["warnings"] == []


def test_plan_recipe_json_has_checker_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _write_recipe(tmp_path, train={"gradient_accumulation_steps": 1})
    assert main(["plan", str(recipe), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bubble_fraction"] == pytest.approx(0.5)
    assert len(data["warnings"]) == 1 and "train.gradient_accumulation_steps" in data["warnings"][0]


def test_plan_svg_writes_a_picture(tmp_path: Path) -> None:
    target = tmp_path / "plan.svg"
    assert main([*REFERENCE_FLAGS, "--svg", str(target)]) == 0
    assert "<svg" in target.read_text()[:2000]


def test_plan_without_recipe_needs_degrees(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--world-size", "16"]) == 2
    assert "--tp, --pp" in capsys.readouterr().err


def test_plan_nodes_give_the_world(capsys: pytest.CaptureFixture[str]) -> None:
    """--nodes belongs to the --auto options; without --world-size it sets the world for a plain plan."""
    assert main(["plan", "--nodes", "2", "--gpus-per-node", "8", "--tp", "2", "--pp", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dp_groups"][:2] == [[0, 2], [1, 3]]


def test_plan_degrees_must_multiply_to_world(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*REFERENCE_FLAGS, "--dp", "4"]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_plan_flags_warn_about_cross_node_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--world-size", "8", "--gpus-per-node", "2", "--tp", "4", "--pp", "1", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["cross_node"]["tp_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and "--tp" in data["warnings"][0]


def test_check_clean_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(TINY)]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")


def test_check_zero3_with_pipeline_exits_2_with_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _write_recipe(tmp_path, zero={"stage": 3}, parallel={"stage_layers": [1, 1]})
    assert main(["check", str(recipe)]) == 2
    out = capsys.readouterr().out
    assert "zero.stage = 3" in out and "reduce-scatter" in out and "zero.stage: 1" in out
    assert "parallel.stage_layers" in out and "2 error(s)" in out  # every error, not only the first


def test_check_unknown_key_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _write_recipe(tmp_path, train={"lrr": 1.0})
    assert main(["check", str(recipe)]) == 2
    assert "train.lrr" in capsys.readouterr().err


def test_check_world_size_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(TINY), "--world-size", "4"]) == 2
    assert "--world-size 4" in capsys.readouterr().out


def test_config_writes_the_golden_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.json"
    assert main(["config", str(TINY), "-o", str(out)]) == 0
    assert out.read_text() == (ROOT / "ds_configs" / "tiny-llama-3d.json").read_text()
    assert capsys.readouterr().out.strip() == str(out)


def test_config_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(TINY, tmp_path / "mine.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["config", "mine.yaml"]) == 0
    assert json.loads((tmp_path / "ds_configs" / "mine.json").read_text())["train_batch_size"] == 16


def test_config_refuses_a_bad_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _write_recipe(tmp_path, zero={"stage": 2})
    out = tmp_path / "never.json"
    assert main(["config", str(recipe), "-o", str(out)]) == 2
    assert not out.exists() and "zero.stage" in capsys.readouterr().err


def test_sizes_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check", str(TINY), "--world-size", "0"])
    assert exc.value.code == 2 and "expected an integer in [1, " in capsys.readouterr().err


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_plan_and_estimate_show_the_engines_split(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dsx3d plan` and `dsx3d estimate` report the decoder layers per stage that the engine builds, for
    every shipped recipe (one split function serves all three)."""
    from dsx3d.pipeline.module import stage_bounds
    from dsx3d.recipe.hf_config import load_hf_config
    from dsx3d.recipe.schema import load_recipe

    r = load_recipe(recipe)
    if r.parallel.pp == 1:
        pytest.skip("no pipeline split")
    capsys.readouterr()  # DeepSpeed announces its accelerator on stdout when first imported
    assert main(["plan", str(recipe), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["stage_layers"]
    assert main(["estimate", str(recipe), "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert planned == estimated["stage_layers"] == [st["layers"] for st in estimated["stages"]]
    config = load_hf_config(r.model)
    bounds = stage_bounds(config, r.parallel.pp, r.train.seq_len, r.parallel.stage_layers)
    n = config.num_hidden_layers
    assert planned == [len(set(range(a, b)) & set(range(1, n + 1))) for a, b in zip(bounds[:-1], bounds[1:])]
    assert main(["plan", str(recipe)]) == 0
    assert f"decoder layers per stage: {planned}" in capsys.readouterr().out


def test_help_and_version_are_quick_to_reach(capsys: pytest.CaptureFixture[str]) -> None:
    """`dsx3d --help` lists every command without importing any command module (they pull in torch)."""
    import subprocess
    import sys

    code = (
        "import sys; from dsx3d.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'pydantic') if m in sys.modules]\n"
        "sys.exit(1 if heavy else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("plan", "check", "config", "verify", "estimate", "train", "export", "accelerate-config"):
        assert f"    {name}" in out.stdout
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    from dsx3d import __version__

    assert capsys.readouterr().out.strip() == f"dsx3d {__version__}"


@pytest.mark.parametrize("flag", ["-o", "--ds-config"])
def test_a_file_name_too_long_is_refused_before_writing(tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the CLI fuzz: ENAMETOOLONG from the atomic writer ended in a traceback."""
    long = str(tmp_path / ("a" * 300 + ".json"))
    args = ["-o", long] if flag == "-o" else ["-o", str(tmp_path / "acc.yaml"), "--ds-config", long]
    assert main(["accelerate-config", str(TINY), *args]) == 2
    err = capsys.readouterr().err
    assert "has a name of 305 bytes" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
