"""`dsx3d train`'s pure pieces, no processes: the launcher command line, hostfiles, checkpoint tags and the
atomic `latest`, metrics.jsonl, the loss plot, failure messages, and the refusals that must come before
any process starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig

from dsx3d.checkpoint.training.checkpointer import prune, tags_to_delete
from dsx3d.checkpoint.training.disk_format import LATEST, read_latest, tag_for
from dsx3d.cli import main
from dsx3d.cli.cmd_train import describe_exit
from dsx3d.errors import UserError
from dsx3d.fsio import write_atomic
from dsx3d.recipe.schema import load_recipe, recipe_from_dict
from dsx3d.run.data import check_vocab
from dsx3d.run.launch import check_hosts, launcher_command, rank_environment, read_hostfile
from dsx3d.run.metrics import Throughput, read_metrics
from dsx3d.run.outputs import RunPaths, check_start
from dsx3d.run.plot import plot_loss
from dsx3d.run.progress import Reporter, format_duration
from dsx3d.run.ranks import (
    PeerDied,
    RankInfo,
    dead_peers,
    failure_message,
    misplaced_ranks,
    naming_dead_peers,
)
from dsx3d.train import parse_args

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-llama-3d.yaml"


def _recipe(tmp_path: Path, **sections: dict) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["output_dir"] = str(tmp_path / "run")
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --- the launcher command line ---------------------------------------------------------------------------


def test_single_node_command_starts_gpus_per_node_ranks_of_the_module() -> None:
    cmd = launcher_command(
        "r.yaml", load_recipe(TINY), hostfile=None, launcher_args=[], rank_args=["--resume"]
    )
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert cmd[3:] == [
        "--num_gpus",
        "8",
        "--log_level",
        "warning",
        "--module",
        "dsx3d.train",
        "r.yaml",
        "--resume",
    ]


def test_multi_node_command_passes_hostfile_nodes_and_launcher_args() -> None:
    recipe = recipe_from_dict(
        {**yaml.safe_load(TINY.read_text()), "cluster": {"nodes": 2, "gpus_per_node": 4}}
    )
    args = ["--no_ssh", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port=29511"]
    cmd = launcher_command("r.yaml", recipe, hostfile="hosts", launcher_args=args, rank_args=[])
    assert cmd[3:] == [
        "--hostfile", "hosts", "--num_nodes", "2", "--num_gpus", "4", "--log_level", "warning",
        *args, "--module", "dsx3d.train", "r.yaml",
    ]  # fmt: skip


def test_users_resource_options_replace_ours() -> None:
    """--include with --num_gpus makes the launcher fail ("Cannot specify num_nodes/gpus with include")."""
    cmd = launcher_command(
        "r.yaml",
        load_recipe(TINY),
        hostfile=None,
        launcher_args=["--include=localhost:0,1", "--log_level=info"],
        rank_args=[],
    )
    assert "--num_gpus" not in cmd and "--log_level" not in cmd and "--include=localhost:0,1" in cmd


def test_multi_node_recipe_needs_a_hostfile() -> None:
    recipe = recipe_from_dict(
        {**yaml.safe_load(TINY.read_text()), "cluster": {"nodes": 2, "gpus_per_node": 4}}
    )
    with pytest.raises(UserError, match="--hostfile"):
        launcher_command("r.yaml", recipe, hostfile=None, launcher_args=[], rank_args=[])


def test_rank_environment_defaults_one_thread_but_keeps_the_users() -> None:
    assert rank_environment({})["OMP_NUM_THREADS"] == "1"
    assert rank_environment({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_hostfile_parsing_and_checks(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nlocalhost slots=4\n\n127.0.0.1 slots=2  # small\n")
    hosts = read_hostfile(hostfile)
    assert [(h.name, h.slots) for h in hosts] == [("localhost", 4), ("127.0.0.1", 2)]
    recipe = recipe_from_dict(
        {**yaml.safe_load(TINY.read_text()), "cluster": {"nodes": 2, "gpus_per_node": 4}}
    )
    with pytest.raises(UserError, match="'127.0.0.1': fewer slots than cluster.gpus_per_node = 4"):
        check_hosts(hosts, recipe)
    with pytest.raises(UserError, match="cluster.nodes = 3"):
        check_hosts(
            hosts, recipe_from_dict({**recipe.model_dump(), "cluster": {"nodes": 3, "gpus_per_node": 2}})
        )
    hostfile.write_text("localhost 4\n")
    with pytest.raises(UserError, match="line 1"):
        read_hostfile(hostfile)


# --- the refusals before any process starts ---------------------------------------------------------------


def test_bad_recipe_exits_2_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(tmp_path, zero={"stage": 3})
    assert main(["train", str(recipe)]) == 2
    assert "zero.stage" in capsys.readouterr().err


def test_earlier_run_needs_resume_or_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(tmp_path)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / LATEST).write_text(tag_for(20))
    assert main(["train", str(recipe)]) == 2
    assert "--resume" in capsys.readouterr().err
    # `latest` names a tag that is not there: a resume says so before any process starts
    assert main(["train", str(recipe), "--resume", "--dry-run"]) == 2
    assert f"{tag_for(20)}: missing" in capsys.readouterr().err
    assert main(["train", str(recipe), "--overwrite", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("--module dsx3d.train " + str(recipe) + " --overwrite")
    assert "--overwrite: removing the earlier run's files" in captured.err and "checkpoints/" in captured.err


def test_own_options_are_found_among_launcher_args(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse leaves everything after RECIPE to the launcher; --hostfile/--overwrite there are still ours."""
    recipe = _recipe(tmp_path, cluster={"nodes": 2, "gpus_per_node": 4})
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=4\n127.0.0.1 slots=4\n")
    argv = [
        "train",
        str(recipe),
        "--no_ssh",
        "--hostfile",
        str(hosts),
        "--node_rank",
        "1",
        "--overwrite",
        "--pg-timeout-s",
        "30",
        "--dry-run",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"--hostfile {hosts} --num_nodes 2 --num_gpus 4" in out and "--no_ssh --node_rank 1" in out
    assert out.strip().endswith("--overwrite --pg-timeout-s 30.0")


def test_rank_entry_accepts_the_launchers_local_rank() -> None:
    args = parse_args(["--local_rank=3", "r.yaml", "--resume"])
    assert (args.recipe, args.resume, args.local_rank) == ("r.yaml", True, 3)


def test_check_start_allows_fresh_dirs_and_explicit_choices(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    check_start(paths, resume=False, overwrite=False)  # nothing there yet
    paths.checkpoints.mkdir()
    (paths.checkpoints / "step-000010").mkdir()  # a crash during the first save: no latest, nothing to keep
    check_start(paths, resume=False, overwrite=False)
    write_atomic(paths.checkpoints / LATEST, "step-000010")
    with pytest.raises(UserError):
        check_start(paths, resume=False, overwrite=False)
    check_start(paths, resume=True, overwrite=False)
    check_start(paths, resume=False, overwrite=True)


def test_vocab_smaller_than_the_tokenizer_is_refused() -> None:
    class Tok:
        def __len__(self) -> int:
            return 2050

    with pytest.raises(UserError, match="vocab_size = 2048.*2050 tokens"):
        check_vocab(Tok(), LlamaConfig(vocab_size=2048))  # type: ignore[arg-type]
    check_vocab(Tok(), LlamaConfig(vocab_size=2050))  # type: ignore[arg-type]


def test_describe_exit_names_the_signal() -> None:
    assert describe_exit(247) == "launcher exit code 247: a rank was killed by SIGKILL"
    assert describe_exit(1) == "launcher exit code 1"


# --- checkpoints ------------------------------------------------------------------------------------------


def test_tags_to_delete_keeps_the_newest_and_leaves_later_partial_ones() -> None:
    tags = [tag_for(s) for s in (10, 20, 30, 40)] + ["rng", ".deleting-step-000005"]
    assert tags_to_delete(tags, tag_for(30), keep=2) == [tag_for(10)]  # step 40: a save that crashed
    assert tags_to_delete(tags, tag_for(40), keep=1) == [tag_for(10), tag_for(20), tag_for(30)]
    assert tags_to_delete(tags, tag_for(40), keep=5) == []


def test_prune_deletes_only_behind_latest(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        (tmp_path / tag_for(step) / "rng").mkdir(parents=True)
        (tmp_path / tag_for(step) / "mp_rank_00_model_states.pt").write_text("x")
        (tmp_path / tag_for(step) / "rng" / "rank-00000.pt").write_text("x")
    write_atomic(tmp_path / LATEST, tag_for(20))
    assert prune(tmp_path, keep=1) == [tag_for(10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, tag_for(20), tag_for(30)]


def test_prune_keeps_files_dsx3d_did_not_write(tmp_path: Path) -> None:
    """A user's file inside an old tag survives pruning (and so does its directory)."""
    for step in (10, 20):
        (tmp_path / tag_for(step)).mkdir()
        (tmp_path / tag_for(step) / "mp_rank_00_model_states.pt").write_text("x")
    (tmp_path / tag_for(10) / "notes.txt").write_text("mine")
    write_atomic(tmp_path / LATEST, tag_for(20))
    prune(tmp_path, keep=1)
    assert sorted(p.name for p in (tmp_path / tag_for(10)).iterdir()) == ["notes.txt"]


def test_latest_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer dying before the rename leaves the previous `latest` whole, and no temporary file."""
    write_atomic(tmp_path / LATEST, tag_for(20))

    def crash(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / LATEST, tag_for(40))
    monkeypatch.undo()
    assert read_latest(tmp_path) == tag_for(20)
    assert [p.name for p in tmp_path.iterdir()] == [LATEST]


# --- metrics, progress, plot ------------------------------------------------------------------------------


def test_reporter_writes_a_record_at_first_every_interval_and_last(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    reporter = Reporter(
        path, total_steps=5, start_step=0, log_interval=2, throughput=Throughput(1024, 10**6, 8), enabled=True
    )
    for step in range(1, 6):
        reporter.step(step, loss=10.0 - step, lr=1e-3, grad_norm=0.5, seconds=0.5)
    reporter.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 5]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "eta_s"} <= set(
        records[0]
    )
    assert records[2]["loss"] == 6.0 and records[2]["loss_avg"] == 6.5  # steps 3 and 4
    assert records[2]["tokens_per_s"] == pytest.approx(2048.0)
    assert records[2]["tflops_per_device"] == pytest.approx(6 * 10**6 * 2048 / 8 / 1e12)


def test_reporter_on_other_ranks_writes_nothing(tmp_path: Path) -> None:
    reporter = Reporter(tmp_path / "m.jsonl", 5, 0, 1, Throughput(1, 1, 1), enabled=False)
    reporter.step(1, 1.0, 1.0, 1.0, 1.0)
    reporter.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_read_metrics_keeps_the_last_record_of_a_repeated_step(tmp_path: Path) -> None:
    """A resumed run logs again the steps after its checkpoint; a crash can cut the last line short."""
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"step": 2, "loss": 2.5},
        {"step": 3, "loss": 1.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 3.0), (2, 2.5), (3, 1.0)]


def test_plot_loss_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 / s, "loss_avg": 5.0 / s}) + "\n" for s in (1, 2, 3))
    )
    out = plot_loss(path, tmp_path / "loss.png", "test")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_loss(tmp_path / "none.jsonl", tmp_path / "none.png", "test") is None


def test_format_duration() -> None:
    assert (format_duration(75), format_duration(3725)) == ("1m15s", "1h02m")


# --- failures ---------------------------------------------------------------------------------------------


def _info(rank: int, pid: int, host: str = "h") -> RankInfo:
    return RankInfo(rank=rank, world_size=3, local_rank=rank, launcher_node=0, host=host, pid=pid)


def test_a_lost_connection_names_the_peer_that_died() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me, dead, alive, remote = (
        _info(0, os.getpid()),
        _info(1, gone.pid),
        _info(2, os.getppid()),
        _info(3, gone.pid, "other"),
    )
    assert dead_peers(me, [me, dead, alive, remote]) == [dead]
    with pytest.raises(PeerDied) as exc, naming_dead_peers(me, [me, dead, alive]):
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:9959: Connection reset by peer")
    assert str(exc.value) == f"{me.where()} stopped: {dead.where()} died"
    assert failure_message(me, exc.value) == str(exc.value)
    with (
        pytest.raises(ValueError),
        naming_dead_peers(me, [me, dead]),
    ):  # a root cause passes through untouched
        raise ValueError("bad value")
    assert "failed: ValueError: bad value" in failure_message(me, ValueError("bad value"))


def test_a_rank_that_stopped_after_losing_a_peer_is_not_named_as_the_cause() -> None:
    """Rank 1 stopped because rank 2 died; rank 0, noticing later, must name only rank 2."""
    from dsx3d.run.ranks import _stopped_dir

    gone = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for p in gone:
        p.wait()
    me, echo, root = _info(0, os.getpid()), _info(1, gone[0].pid), _info(2, gone[1].pid)
    peers = [me, echo, root]
    try:
        with pytest.raises(PeerDied), naming_dead_peers(echo, peers):  # rank 1's own stop leaves its marker
            raise RuntimeError("Connection closed by peer")
        assert dead_peers(me, peers) == [root]
    finally:
        shutil.rmtree(_stopped_dir(peers), ignore_errors=True)


def test_misplaced_ranks_are_those_the_launcher_put_elsewhere() -> None:
    rows = [{"rank": 0, "launcher_node": 0, "node": 0}, {"rank": 1, "launcher_node": 0, "node": 1}]
    assert misplaced_ranks(rows) == [1]
