"""`parallel.zb_costs: auto` on the command line: `dsx3d estimate`, which cannot time the engine, estimates
equal costs (the same figures as an unset zb_costs); `dsx3d check` refuses auto with 1f1b (nothing to measure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dsx3d.cli import main


def _recipe(tmp_path: Path, **parallel: object) -> str:
    path = tmp_path / f"r{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096}},
        "parallel": {"dp": 1, "tp": 1, "pp": 2, **parallel},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "train": {"gradient_accumulation_steps": 4, "seq_len": 32},
    }))
    return str(path)


def test_estimate_assumes_equal_costs_for_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    figures = []
    for costs in ({"zb_costs": "auto"}, {}, {"zb_costs": [1.0, 1.5, 0.5]}):
        assert main(["estimate", _recipe(tmp_path, schedule="zb-h1", **costs), "--json"]) == 0
        figures.append(json.loads(capsys.readouterr().out))
    assert figures[0] == figures[1] != figures[2]


def test_check_refuses_auto_with_1f1b(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", _recipe(tmp_path, zb_costs="auto")]) == 2
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "parallel.zb_costs" in out and "schedule: zb-h1" in out and "Traceback" not in out
