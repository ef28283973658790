"""Every command that takes a Hugging Face config path reads a JSON file of any name as the config itself,
and a directory through its config.json: `verify --config` and `plan --auto --model` (which estimate's
model reader serves)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dsx3d.cli.cmd_estimate import load_model
from dsx3d.cli.cmd_verify import _config_and_model
from dsx3d.models.known_families import tiny_config


def _write(tmp_path: Path, name: str) -> Path:
    config = tiny_config("qwen3", hidden_size=96)
    folder = tmp_path / name.replace(".", "_")
    folder.mkdir()
    config.to_json_file(folder / name)
    return folder / name


@pytest.mark.parametrize("name", ["model.json", "qwen3-tiny.config.json", "config.json"])
def test_verify_config_file_of_any_name(tmp_path: Path, name: str) -> None:
    path = _write(tmp_path, name)
    args = argparse.Namespace(model=None, config=str(path), arch=None)
    config, model, _ = _config_and_model(args)
    assert (config.model_type, config.hidden_size, model) == ("qwen3", 96, None)
    # the folder form keeps working where the folder holds config.json
    if name == "config.json":
        config, _, _ = _config_and_model(argparse.Namespace(model=None, config=str(path.parent), arch=None))
        assert config.hidden_size == 96


@pytest.mark.parametrize("name", ["model.json", "config.json"])
def test_plan_model_file_of_any_name(tmp_path: Path, name: str) -> None:
    path = _write(tmp_path, name)
    _, hf_config, recipe = load_model(str(path))
    assert (hf_config.model_type, hf_config.hidden_size, recipe) == ("qwen3", 96, None)
