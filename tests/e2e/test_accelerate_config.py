"""`dsx3d accelerate-config`: the accelerate launch config of a recipe, and (slow) the example Trainer script run
through a real `accelerate launch --config_file` on 4 processes, matching plain single-process transformers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsx3d.cli import main
from dsx3d.errors import UserError
from dsx3d.recipe.accelerate_config import accelerate_config
from dsx3d.recipe.schema import load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-llama-3d.yaml"


def _two_node_recipe() -> dict[str, Any]:
    return {
        "model": {"config": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}},
        "parallel": {"tp": 2, "pp": 2},
        "cluster": {"nodes": 2, "gpus_per_node": 4},
    }


def test_single_node_config_names_the_json_and_the_process_count(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    out = tmp_path / "acc.yaml"
    assert main(["accelerate-config", str(TINY), "-o", str(out)]) == 0
    recipe = load_recipe(TINY)
    layout, train = recipe.layout(), recipe.train
    config = ClusterConfig.from_yaml_file(str(out))  # accelerate's own reader: no unknown keys
    assert config.distributed_type.value == "DEEPSPEED" and not config.use_cpu
    assert (
        (config.num_processes, config.num_machines)
        == (recipe.cluster_world_size, recipe.cluster.nodes)
        == (8, 1)
    )
    ds_path = Path(config.deepspeed_config["deepspeed_config_file"])
    assert ds_path.is_absolute() and ds_path == tmp_path / "acc.ds.json"
    ds = json.loads(ds_path.read_text())
    assert (ds["dsx3d"]["dp"], ds["dsx3d"]["tp"], ds["dsx3d"]["pp"]) == (layout.dp, layout.tp, layout.pp)
    # micro x accumulation x dp, not x the world size that accelerate's "auto" would use
    assert ds["train_batch_size"] == train.micro_batch_size * train.gradient_accumulation_steps * layout.dp
    assert "deepspeed_multinode_launcher" not in config.deepspeed_config
    # accelerate refuses mixed_precision next to a deepspeed_config_file; the JSON decides precision
    assert "mixed_precision" not in yaml.safe_load(out.read_text())


def test_multi_node_config_uses_the_standard_launcher(tmp_path: Path) -> None:
    recipe = recipe_from_dict(_two_node_recipe())
    with pytest.raises(UserError, match="--main-process-ip"):
        accelerate_config(recipe, tmp_path / "ds.json")
    config = accelerate_config(
        recipe, tmp_path / "ds.json", main_process_ip="10.0.0.1", main_process_port=29600
    )
    assert config["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"  # not pdsh
    assert (config["num_machines"], config["num_processes"], config["machine_rank"]) == (2, 8, 0)
    assert (config["main_process_ip"], config["main_process_port"]) == ("10.0.0.1", 29600)


def test_cli_refuses_multi_node_without_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "two-nodes.yaml"
    recipe.write_text(yaml.safe_dump(_two_node_recipe()))
    assert main(["accelerate-config", str(recipe), "-o", str(tmp_path / "acc.yaml")]) == 2
    assert "--main-process-ip" in capsys.readouterr().err
    assert not (tmp_path / "acc.ds.json").exists()  # nothing written on error
    out = tmp_path / "ok.yaml"
    assert main(["accelerate-config", str(recipe), "-o", str(out), "--main-process-ip", "127.0.0.1"]) == 0
    assert yaml.safe_load(out.read_text())["num_machines"] == 2


# -- real launcher runs ------------------------------------------------------------------------------------

EXAMPLES = ROOT / "scripts" / "examples"
SEQ = 32


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _reference(rank: int, argv: list[str]) -> dict[str, Any]:
    """run_clm.py before the switch: plain transformers.Trainer on one process, the same global batch."""
    import transformers

    module = _example("run_clm")
    module.Trainer = transformers.Trainer
    return module.main(argv)


def _launch(tmp_path: Path, config: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port", "0"]
    return subprocess.run([*launch, *command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _layout_recipe(path: Path, model: Path, pp: int, dp: int, **extra: Any) -> Path:
    recipe = {
        "model": {"name_or_path": str(model)},
        "parallel": {"dp": dp, "tp": 1, "pp": pp},
        "cluster": {"nodes": 1, "gpus_per_node": dp * pp},
        "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "seq_len": SEQ, "dtype": "fp32", "grad_clip": 1.0},
        "zero": {"stage": 1},
        **extra,
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
@pytest.mark.usefixtures("warm")
def test_run_clm_under_accelerate_launch_matches_plain_transformers(tmp_path: Path) -> None:
    """4 processes (pp 2 x dp 2) started by `accelerate launch --config_file`: accelerate's environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*, ACCELERATE_DEEPSPEED_CONFIG_FILE) and its CPU quirk (one
    process reported per rank unless gloo) are handled; the script takes the layout from accelerate's
    DeepSpeed config, and the losses equal single-process transformers."""
    from dsx3d.verify.harness import run_ranks

    model_dir = _example("run_clm").make_tiny_checkpoint(tmp_path / "tiny")
    recipe = _layout_recipe(tmp_path / "recipe.yaml", model_dir, pp=2, dp=2)
    assert main(["accelerate-config", str(recipe), "-o", str(tmp_path / "acc.yaml")]) == 0
    common = ["--model_name_or_path", str(model_dir), "--max_steps", "3", "--do_train", "--do_eval", "--logging_steps", "1",
              "--report_to", "none", "--disable_tqdm", "true", "--max_train_samples", "32", "--max_eval_samples", "8",
              "--block_size", str(SEQ), "--save_strategy", "no"]  # fmt: skip
    log_json = tmp_path / "log.json"
    proc = _launch(tmp_path, tmp_path / "acc.yaml", str(EXAMPLES / "run_clm.py"), *common,
                   "--output_dir", str(tmp_path / "out"), "--log_json", str(log_json))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ours = json.loads(log_json.read_text())
    ref_args = ["--output_dir", str(tmp_path / "ref"), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]
    ref = run_ranks(_reference, 1, [*common, *ref_args])[0]
    losses = [[h["loss"] for h in r["log_history"] if "loss" in h] for r in (ours, ref)]
    assert len(losses[0]) == len(losses[1]) == 3, losses
    assert max(abs(a - b) for a, b in zip(*losses, strict=True)) <= 1e-5, losses
    assert abs(ours["metrics"]["eval_loss"] - ref["metrics"]["eval_loss"]) <= 1e-5, (ours["metrics"], ref["metrics"])
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.slow
def test_dsx3d_train_module_under_accelerate_launch(tmp_path: Path) -> None:
    """`accelerate launch --config_file acc.yaml -m dsx3d.train RECIPE` (pp 2, 2 processes) trains the recipe."""
    from dsx3d.run.metrics import read_metrics

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 512,
                                     "max_position_embeddings": 64, "tie_word_embeddings": False}},
                "parallel": {"dp": 1, "tp": 1, "pp": 2},
                "cluster": {"nodes": 1, "gpus_per_node": 2},
                "train": {"steps": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "seq_len": SEQ, "dtype": "fp32"},
                "data": {"tokenizer_vocab_size": 512, "cache_dir": str(tmp_path / "cache")},
                "output_dir": str(tmp_path / "run"),
            }
        )
    )  # fmt: skip
    assert main(["accelerate-config", str(recipe), "-o", str(tmp_path / "acc.yaml")]) == 0
    proc = _launch(tmp_path, tmp_path / "acc.yaml", "-m", "dsx3d.train", str(recipe))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
