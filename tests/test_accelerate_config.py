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
from dsx3d.integrations.accelerate_config import accelerate_config
from dsx3d.recipe import load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parent.parent
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


# -- a real launcher run ---------------------------------------------------------------------------------------

EXAMPLE = ROOT / "scripts" / "examples" / "trainer.py"
STEPS, TRAIN, EVAL, SEQ = 3, 32, 8, 32


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("example_trainer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(rank: int, model_dir: Path, work: Path, dp: int) -> dict[str, Any]:
    """The example's job as plain transformers.Trainer on one process (accumulation x dp, same global batch)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    ex = _example()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_set, eval_set = ex.build_datasets(tokenizer, SEQ, TRAIN, EVAL)
    layout = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2 * dp,
        "max_grad_norm": 1.0,
        "bf16": False,
    }
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=ex.training_arguments(work / "ref", layout, STEPS, 2e-3, 0),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        train_dataset=train_set,
        eval_dataset=eval_set,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "eval_before": before}


@pytest.mark.slow
@pytest.mark.usefixtures("warm")
def test_example_under_accelerate_launch_matches_plain_transformers(tmp_path: Path) -> None:
    """4 processes (pp 2 x dp 2) started by `accelerate launch --config_file`: accelerate's environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*, ACCELERATE_DEEPSPEED_CONFIG_FILE) and its CPU quirk (one
    process reported per rank unless gloo) are handled, and the losses equal single-process transformers."""
    from dsx3d.testing.harness import run_ranks

    model_dir = _example().make_tiny_checkpoint(tmp_path / "tiny")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(model_dir)},
                "parallel": {"dp": 2, "tp": 1, "pp": 2},
                "cluster": {"nodes": 1, "gpus_per_node": 4},
                "train": {
                    "micro_batch_size": 2,
                    "gradient_accumulation_steps": 2,
                    "seq_len": SEQ,
                    "dtype": "fp32",
                    "grad_clip": 1.0,
                },
                "zero": {"stage": 1},
            }
        )
    )
    assert main(["accelerate-config", str(recipe), "-o", str(tmp_path / "acc.yaml")]) == 0
    log_json = tmp_path / "log.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "acc.yaml"),
        "--main_process_port", "0", str(EXAMPLE), "--model", str(model_dir), "--output-dir", str(tmp_path / "out"),
        "--steps", str(STEPS), "--train-samples", str(TRAIN), "--eval-samples", str(EVAL), "--log-json", str(log_json),
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ours = json.loads(log_json.read_text())
    ref = run_ranks(_reference, 1, model_dir, tmp_path, 2)[0]
    losses = [h["loss"] for h in ours["log_history"] if "loss" in h]
    assert len(losses) == len(ref["losses"]) == STEPS, (losses, ref["losses"])
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)) <= 1e-5, (
        losses,
        ref["losses"],
    )
    assert abs(ours["eval_before"] - ref["eval_before"]) <= 1e-5
    assert (tmp_path / "out" / "final" / "config.json").is_file()
