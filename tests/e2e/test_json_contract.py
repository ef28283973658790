"""Every command that offers --json prints exactly one JSON object on stdout, run as a user runs it
(`python -m dsx3d ...` in a subprocess); third-party log lines go to stderr. The commands are read from the
CLI's own parsers, so a new --json command without an invocation here fails the test."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsx3d.cli import build_parser

pytestmark = pytest.mark.slow


def _commands_with_json() -> set[str]:
    parser = build_parser(None)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name
        for name, p in sub.choices.items()
        if any("--json" in a.option_strings for a in p._actions)
    }


def _invocations(tmp_path: Path) -> dict[str, list[list[str]]]:
    from dsx3d.models.known_families import tiny_config

    model = tmp_path / "model.json"
    tiny_config("llama", vocab_size=4096).to_json_file(model)
    return {
        "plan": [
            ["plan", "--dp", "2", "--tp", "2", "--pp", "2", "--json"],
            ["plan", "--auto", "--model", str(model), "--nodes", "1", "--gpus-per-node", "4", "--gpu-memory-gb", "80", "--seq-len", "32", "--json"],
        ],
        "estimate": [["estimate", "--params", "7.5e9", "--dp", "64", "--json"]],
        "verify": [["verify", "--arch", "llama", "--dp", "1", "--tp", "2", "--pp", "1", "--steps", "1", "--json"]],
    }


def test_every_json_command_prints_one_object(tmp_path: Path) -> None:
    invocations = _invocations(tmp_path)
    assert _commands_with_json() == set(invocations), "give each command offering --json an invocation here"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    runs = [
        (args, subprocess.Popen([sys.executable, "-m", "dsx3d", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        for cmds in invocations.values()
        for args in cmds
    ]
    for args, proc in runs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (args, err[-2000:])
        assert isinstance(json.loads(out), dict), (args, out[:500])
        assert out.count("\n") == 1, (args, out[:500])
        if args[0] == "verify":
            # verify's own SGD run is not a user's override: no warning about it
            assert "replaces 'AdamW'" not in err, err[-2000:]
