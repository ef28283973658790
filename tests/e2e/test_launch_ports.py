"""Two single-node runs on one machine do not collide on the rendezvous port: `dsx3d train` picks a free
one itself; a port the user names is kept, and refused with the flag to change when it is busy."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import yaml

from dsx3d.cli import main
from dsx3d.run.ports import port_is_free
from tests.helpers.recipes import tiny_recipe_dict

DEEPSPEED_DEFAULT_PORT = 29500


def _recipe(tmp_path: Path, nodes: int = 1) -> Path:
    path = tmp_path / f"r{nodes}.yaml"
    recipe = tiny_recipe_dict(
        cluster={"nodes": nodes, "gpus_per_node": 4 // nodes},
        output_dir=str(tmp_path / f"run{nodes}"),
        data={"cache_dir": str(tmp_path / "cache")},
    )
    path.write_text(yaml.safe_dump(recipe))
    return path


def _listen(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", *args, "--dry-run"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _port(command: str) -> int | None:
    match = re.search(r"--master_port[= ](\d+)", command)
    return int(match.group(1)) if match else None


def test_single_node_runs_pick_free_ports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(_recipe(tmp_path))
    held = []
    try:
        # the launcher's default port is taken (a first run), when this machine lets the test take it
        try:
            held.append(_listen(DEEPSPEED_DEFAULT_PORT))
        except OSError:
            pass
        code, out, err = _dry_run(capsys, recipe)
        assert code == 0, err
        first = _port(out)
        assert first is not None and first != DEEPSPEED_DEFAULT_PORT and port_is_free(first)
        held.append(_listen(first))  # the first run now listens there: a second run goes elsewhere
        code, out, err = _dry_run(capsys, recipe)
        second = _port(out)
        assert code == 0 and second not in (None, first) and port_is_free(second)
    finally:
        for s in held:
            s.close()


def test_busy_named_port_is_refused_with_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    busy = _listen()
    try:
        port = busy.getsockname()[1]
        code, _, err = _dry_run(capsys, str(_recipe(tmp_path)), "--master_port", str(port))
    finally:
        busy.close()
    assert code == 2
    assert f"--master_port = {port}" in err and "already in use" in err and "Traceback" not in err


def test_named_ports_are_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _dry_run(capsys, str(_recipe(tmp_path)), "--master_port=29517")
    assert code == 0 and _port(out) == 29517 and out.count("--master_port") == 1, err
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    # multi-node: every node must agree, so dsx3d neither adds a port nor checks the master's
    code, out, err = _dry_run(capsys, str(_recipe(tmp_path, nodes=2)), "--hostfile", str(hostfile))
    assert code == 0 and "--master_port" not in out, err
