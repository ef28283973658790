"""Real launches of `dsx3d.train` on 4 local CPU processes (dp 1 x tp 2 x pp 2): `dsx3d train` on the deepspeed
launcher, two launchers simulating two nodes on loopback, torchrun, and a rank killed mid-run.

Each launch costs about 10 s of CPU per rank in imports, so these are few, tiny and `slow`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from dsx3d.checkpoint.training.disk_format import read_latest, tag_for
from dsx3d.run.metrics import read_metrics
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = pytest.mark.slow

STEPS = 4
LAUNCH_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_recipe(
    path: Path, output_dir: Path, cache_dir: Path, *, nodes: int = 1, steps: int = STEPS
) -> Path:
    recipe = tiny_recipe_dict(
        cluster={"nodes": nodes, "gpus_per_node": 4 // nodes},
        train={"steps": steps, "save_interval": 2},
        data={"cache_dir": str(cache_dir)},
        output_dir=str(output_dir),
    )
    path.write_text(yaml.safe_dump(recipe))
    return path


def environment(tmp: Path) -> dict[str, str]:
    # A private extension dir: a launched run must never JIT-build DeepSpeed's shared-memory op into it.
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp / "torch_extensions"), "PYTHONUNBUFFERED": "1"}


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def losses_of(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dsx3d-cache")


@pytest.fixture(scope="module")
def single_launcher(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Any]:
    """`dsx3d train RECIPE` with all 4 ranks under one deepspeed launcher: the reference run."""
    tmp = tmp_path_factory.mktemp("single")
    recipe = write_recipe(tmp / "r.yaml", tmp / "run", cache_dir)
    began = time.monotonic()
    proc = start(
        [sys.executable, "-m", "dsx3d", "train", str(recipe), "--master_port", str(free_port())],
        environment(tmp),
        tmp / "out.log",
    )
    code = finish(proc)
    return {
        "tmp": tmp,
        "out": tmp / "run",
        "code": code,
        "log": (tmp / "out.log").read_text(),
        "seconds": time.monotonic() - began,
    }


def test_dsx3d_train_runs_end_to_end(single_launcher: dict[str, Any]) -> None:
    log, out = single_launcher["log"], single_launcher["out"]
    assert single_launcher["code"] == 0, log[-4000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert f"step {STEPS}/{STEPS} | loss" in log  # the log line of rank 0
    assert read_latest(out / "checkpoints") == tag_for(STEPS)
    assert (out / "checkpoints" / tag_for(STEPS) / "dsx3d_recipe.yaml").is_file()
    for name in ("recipe.yaml", "ds_config.json", "loss.png", "tokenizer/tokenizer.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "ds_config.json").read_text())["dsx3d"]["world_size"] == 4
    assert (out / "hf" / "config.json").is_file() or "HF export skipped" in log
    assert not (single_launcher["tmp"] / "torch_extensions").exists(), "a rank built a DeepSpeed op"


def test_two_nodes_on_loopback_place_ranks_as_the_layout_says(
    single_launcher: dict[str, Any], tmp_path: Path, cache_dir: Path
) -> None:
    """Two launchers with --no_ssh and a two-host hostfile act as two nodes of 2 processes: TP pairs stay
    inside a node, the pipeline crosses nodes, and the losses equal the single-launcher run's."""
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", cache_dir, nodes=2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    port = free_port()
    procs = [
        start(
            [
                sys.executable, "-m", "dsx3d", "train", str(recipe), "--hostfile", str(hostfile), "--no_ssh",
                "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
            ],
            environment(tmp_path),
            tmp_path / f"node{node}.log",
        )
        for node in (0, 1)
    ]  # fmt: skip
    codes = [finish(p) for p in procs]
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    rows = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert [(r["rank"], r["launcher_node"], r["node"], r["local_rank"]) for r in rows] == [
        (0, 0, 0, 0),
        (1, 0, 0, 1),
        (2, 1, 1, 0),
        (3, 1, 1, 1),
    ]
    by_rank = {r["rank"]: r for r in rows}
    for tp_group in ([0, 1], [2, 3]):
        assert len({by_rank[r]["launcher_node"] for r in tp_group}) == 1  # TP inside a node
    for pipeline in ([0, 2], [1, 3]):
        assert [by_rank[r]["pp"] for r in pipeline] == [0, 1]
        assert len({by_rank[r]["launcher_node"] for r in pipeline}) == 2  # the pipeline crosses nodes
    assert "step 1/" in logs[0] and "step 1/" not in logs[1]  # rank 0, the reporter, runs on node 0
    assert losses_of(tmp_path / "run") == pytest.approx(losses_of(single_launcher["out"]), abs=1e-6, rel=0)


def test_torchrun_runs_the_same_training(
    single_launcher: dict[str, Any], tmp_path: Path, cache_dir: Path
) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", cache_dir)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "4",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "dsx3d.train", str(recipe),
    ]  # fmt: skip
    code = finish(start(cmd, environment(tmp_path), tmp_path / "out.log"))
    assert code == 0, (tmp_path / "out.log").read_text()[-4000:]
    assert losses_of(tmp_path / "run") == pytest.approx(losses_of(single_launcher["out"]), abs=1e-6, rel=0)


def test_killed_rank_stops_the_whole_job_and_is_named(tmp_path: Path, cache_dir: Path) -> None:
    """`deepspeed --module dsx3d.train`: SIGKILL one rank mid-run; the job must end non-zero within a minute
    and say which rank died (the launcher's own message names whichever rank it started last)."""
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", cache_dir, steps=100_000)
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port()),
        "--module", "dsx3d.train", str(recipe),
    ]  # fmt: skip
    proc = start(cmd, environment(tmp_path), tmp_path / "out.log")
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while len(read_metrics(tmp_path / "run" / "metrics.jsonl")) < 2:  # training is under way
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.log").read_text()[
                -4000:
            ]
            time.sleep(0.5)
        victim = next(
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "dsx3d.train" in p.cmdline() and "--local_rank=2" in p.cmdline()
        )
        victim.kill()
        killed = time.monotonic()
        code = proc.wait(90)
        stopped_after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = (tmp_path / "out.log").read_text()
    assert code != 0
    assert stopped_after < 60, stopped_after
    assert f"rank 2 (node 0, local_rank 2, host {socket.gethostname()}, pid {victim.pid}) died" in log, log[
        -4000:
    ]


# --- the job dies with its owner -------------------------------------------------------------------------


def _job_processes(owner: psutil.Process, ranks: int, log: Path) -> list[psutil.Process]:
    """The launcher, its agent and the ranks under `dsx3d train`, once all ranks have started."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while True:
        tree = owner.children(recursive=True)
        if sum("dsx3d.train" in " ".join(p.cmdline()) for p in tree if p.is_running()) >= ranks:
            return tree
        assert owner.is_running() and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def _still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running after `timeout` s (a zombie has ended: only its reaping is left,
    and an orphan's reaper here may never reap it)."""

    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [p for p in procs if running(p)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_every_process_of_the_job_ends_with_dsx3d_train(tmp_path: Path, cache_dir: Path, sig: int) -> None:
    """`dsx3d train` killed (SIGKILL: nothing can be forwarded) or hung up on (a closed terminal): the
    deepspeed launcher, its per-node agent and every rank end too. Two ranks, a run far too long to finish."""
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", cache_dir, steps=100_000)
    data = yaml.safe_load(recipe.read_text())
    data["parallel"], data["cluster"] = {"dp": 1, "tp": 1, "pp": 2}, {"nodes": 1, "gpus_per_node": 2}
    recipe.write_text(yaml.safe_dump(data))
    log = tmp_path / "out.log"
    proc = start(
        [sys.executable, "-m", "dsx3d", "train", str(recipe), "--master_port", str(free_port())],
        environment(tmp_path),
        log,
    )
    try:
        job = _job_processes(psutil.Process(proc.pid), 2, log)
        os.kill(proc.pid, sig)
        killed = time.monotonic()
        code = proc.wait(30)
        alive = _still_running(job, timeout=90)
        assert not alive, ([p.cmdline() for p in alive], log.read_text()[-4000:])
        print(f"{signal.Signals(sig).name}: every process of the job ended {time.monotonic() - killed:.1f} s later")
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGHUP)
    finally:  # whatever the outcome, nothing of this job may outlive the test
        if proc.poll() is None:
            proc.kill()
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if str(recipe) in " ".join(p.cmdline()):
                    p.kill()
