"""Nothing lost, nothing run that the user did not ask for, every bad input a clear error: the pieces, without
training processes (the multi-rank behaviour is in test_train_resume.py and test_train_launch.py).

- the run directory: dsx3d removes only files it wrote, refuses unknown files, says what --overwrite removes,
  refuses dangerous output_dir values;
- checkpoints are data: a pickle payload never runs (its marker file never appears), `latest` and tags are
  single names, a damaged tag is named and the previous complete one chosen, a resume that cannot be exact
  says why;
- a full disk is recognised as such; a dead owner and a hung (stopped) peer are noticed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml

from dsx3d.checkpoint.manifest import record
from dsx3d.checkpoint.safe_load import UnsafeCheckpoint, file_problem, weights_only_loads
from dsx3d.checkpoint.training.checkpointer import (
    choose_tag,
    disk_full,
    rng_state,
    set_rng_state,
    tag_problems,
    write_failure,
)
from dsx3d.checkpoint.training.disk_format import (
    LATEST,
    check_tag,
    files_path,
    foreign_files,
    layer_file_name,
    model_states_name,
    read_latest,
    tag_for,
    zero3_states_name,
)
from dsx3d.checkpoint.training.resume import SavedLayout, plan_resume
from dsx3d.cli import main
from dsx3d.errors import UserError
from dsx3d.fsio import write_atomic
from dsx3d.plan.layout import Layout
from dsx3d.recipe.schema import load_recipe, parse_yaml, recipe_from_dict
from dsx3d.run.lifeline import Owner, beat_file, hung_peers, watch_owner
from dsx3d.run.outputs import RunPaths, check_start, output_dir_problem, remove_earlier_run
from dsx3d.run.ranks import RankInfo
from tests.helpers.payload import write_pickle_payload

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-llama-3d.yaml"
MINIMAL = {"model": {"config": {"model_type": "llama"}}}


# --- the recipe: strict YAML, strict types, finite and bounded numbers -----------------------------------


def test_a_key_given_twice_is_an_error_naming_it(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently: `lr` given twice trained with the second."""
    path = tmp_path / "r.yaml"
    path.write_text("model:\n  config: {model_type: llama}\ntrain:\n  lr: 1.0e-3\n  steps: 2\n  lr: 0.5\n")
    with pytest.raises(UserError, match=r"duplicate key 'lr' \(first given on line 4\)"):
        load_recipe(path)
    # merge keys may still be overridden: that is what they are for
    assert parse_yaml("base: &b {x: 1}\nd:\n  <<: *b\n  x: 2\n")["d"] == {"x": 2}


def test_yaml_12_floats_are_numbers() -> None:
    """YAML 1.1 (PyYAML) reads `1e-3` as a string; strict floats would then refuse a correct recipe."""
    assert parse_yaml("a: 1e-3\nb: 2E5\nc: '1e-3'\nd: 12\n") == {"a": 1e-3, "b": 2e5, "c": "1e-3", "d": 12}


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"model:\n  config: {model_type: llama}\n# \xff\xfe\n", "not UTF-8"),
        (b"\x00" * 10, "not valid YAML"),
        (b"a: &a [1]\nb: &b [*a, *a]\n" + b"x: [" + b"*b, " * 3 + b"*b]\n", "mapping|unknown key"),
    ],
    ids=["latin-1", "binary", "aliases"],
)
def test_unreadable_recipes_are_user_errors(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(content)
    with pytest.raises(UserError, match=words):
        load_recipe(path)


def test_an_alias_bomb_in_a_mapping_value_is_bounded(tmp_path: Path) -> None:
    """A YAML "billion laughs" is small on disk and in memory (aliases share objects) but would be walked
    and written out in full (dsx3d config): it is refused by counting, quickly."""
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb = parse_yaml("\n".join(lines))
    began = time.monotonic()
    with pytest.raises(UserError, match="more than 100000 values"):
        recipe_from_dict({**MINIMAL, "deepspeed": {"x": bomb["l8"]}})
    assert time.monotonic() - began < 5


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("train", {"steps": True}, "train.steps"),
        ("train", {"lr": float("inf")}, "train.lr"),
        ("train", {"lr": float("nan")}, "train.lr"),
        ("train", {"lr": "1e-3"}, "train.lr"),
        ("train", {"lr": 2.0}, "train.lr"),
        ("train", {"betas": [1.0, 0.9]}, "train.betas.0"),
        ("train", {"eps": 0.0}, "train.eps"),
        ("train", {"min_lr": 1.0e-2, "lr": 1.0e-3}, "train"),
        ("train", {"seed": -1}, "train.seed"),
        ("train", {"micro_batch_size": -4}, "train.micro_batch_size"),
        ("train", {"activation_checkpointing": 1}, "train.activation_checkpointing"),
        ("train", {"seq_len": 10**12}, "train.seq_len"),
        ("parallel", {"dp": True}, "parallel.dp"),
        ("parallel", {"tp": "2"}, "parallel.tp"),
        ("cluster", {"nodes": 10**6, "gpus_per_node": 8}, "cluster.nodes"),
        ("cluster", {"nodes": 100_000, "gpus_per_node": 8}, "cluster"),
        ("model", {"config": {"model_type": "llama", "rope_theta": float("inf")}}, "model.config"),
        ("model", {"trust_remote_code": "yes"}, "model.trust_remote_code"),
    ],
)
def test_each_bad_value_is_one_problem_naming_its_key(section: str, values: dict, key: str) -> None:
    data = json.loads(json.dumps(MINIMAL))
    data.setdefault(section, {}).update(values)
    if section == "model" and "config" not in values:
        data["model"]["config"] = {"model_type": "llama"}
    with pytest.raises(UserError) as err:
        recipe_from_dict(data)
    assert [p.key for p in err.value.problems] == [key], err.value


def test_output_dir_must_be_non_empty_and_json_safe_values_only() -> None:
    with pytest.raises(UserError, match="output_dir"):
        recipe_from_dict({**MINIMAL, "output_dir": ""})
    with pytest.raises(UserError, match="JSON cannot hold"):
        recipe_from_dict({**MINIMAL, "deepspeed": {"when": parse_yaml("d: 2020-01-01")["d"]}})


# --- the run directory --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["/", "/tmp", "..", ".", "~", "~/..", "/usr"])
def test_dangerous_output_dirs_are_refused(value: str) -> None:
    assert output_dir_problem(value) is not None
    assert output_dir_problem("runs/x") is None


def _fake_earlier_run(root: Path) -> list[str]:
    """What a run leaves: its manifest names its root and tokenizer files; checkpoints and an export."""
    paths = RunPaths(root)
    for name in ("recipe.yaml", "ds_config.json", "metrics.jsonl"):
        write_atomic(root / name, "x")
    write_atomic(paths.tokenizer / "tokenizer.json", "{}")
    record(root, "run", ["recipe.yaml", "ds_config.json", "metrics.jsonl", "loss.png", "tokenizer/tokenizer.json"])
    for step in (2, 4):
        write_atomic(paths.checkpoints / tag_for(step) / "mp_rank_00_model_states.pt", "x")
        write_atomic(paths.checkpoints / tag_for(step) / "rng" / "rank-00000.pt", "x")
    write_atomic(paths.checkpoints / LATEST, tag_for(4))
    write_atomic(paths.hf / "config.json", "{}")
    record(paths.hf, "export", ["config.json"])
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_fresh_start_never_deletes_files_dsx3d_did_not_write(tmp_path: Path) -> None:
    """The reported loss: without `latest`, a fresh start deleted checkpoints/, hf/ and metrics.jsonl
    whatever they held. Now files dsx3d did not write refuse the start, with or without --overwrite."""
    paths = RunPaths(tmp_path / "run")
    write_atomic(paths.checkpoints / "notes.txt", "mine")
    write_atomic(paths.hf / "model.bin", "mine")
    write_atomic(paths.metrics, "mine")
    for resume, overwrite in ((False, False), (False, True), (True, False)):
        with pytest.raises(UserError, match="did not write.*checkpoints/notes.txt"):
            check_start(paths, resume=resume, overwrite=overwrite)
    assert (paths.checkpoints / "notes.txt").read_text() == "mine" and (paths.hf / "model.bin").is_file()


def test_every_engines_checkpoint_files_are_dsx3d_s_own(tmp_path: Path) -> None:
    """The pipeline engine's layer files, the regular engine's (pp = 1) per-TP-rank modules and its ZeRO-3
    per-DP-rank model and optimizer states: none of them may count as somebody else's file."""
    ckpt = tmp_path / "checkpoints"
    tag = ckpt / tag_for(2)
    names = [layer_file_name(3, 1), model_states_name(1), "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    names += [zero3_states_name(d, t, kind) for d in range(3) for t in range(2) for kind in ("model", "optim")]
    for name in names:
        write_atomic(tag / name, "x")
    write_atomic(tag / "notes.txt", "mine")
    assert foreign_files(ckpt) == [f"{tag.name}/notes.txt"]


def test_overwrite_removes_exactly_the_earlier_runs_files(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ours = _fake_earlier_run(root)
    (root / "notes.txt").write_text("mine")  # beside the run: never touched, never in the way
    paths = RunPaths(root)
    with pytest.raises(UserError, match="holds an earlier run"):
        check_start(paths, resume=False, overwrite=False)
    removed = check_start(paths, resume=False, overwrite=True)
    assert sorted(removed) == ours
    remove_earlier_run(paths, removed)
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


def test_resume_without_a_checkpoint_starts_over_only_over_its_own_files(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ours = _fake_earlier_run(root)
    (root / "checkpoints" / LATEST).unlink()
    assert sorted(check_start(RunPaths(root), resume=True, overwrite=False)) == [
        f for f in ours if f != "checkpoints/latest"
    ]
    assert check_start(RunPaths(tmp_path / "new"), resume=True, overwrite=False) == []


def test_a_resume_does_not_overwrite_a_foreign_recipe_file(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _fake_earlier_run(root)
    record(root, "run", [])  # keep the manifest ...
    (root / "dsx3d_run.json").write_text(json.dumps({"kind": "run", "files": []}))  # ... naming nothing
    with pytest.raises(UserError, match="recipe.yaml"):
        check_start(RunPaths(root), resume=True, overwrite=False)


def test_train_dry_run_with_a_foreign_file_exits_2_and_deletes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(TINY.read_text())
    data["output_dir"] = str(tmp_path / "run")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    write_atomic(tmp_path / "run" / "hf" / "weights.bin", "mine")
    assert main(["train", str(tmp_path / "r.yaml"), "--overwrite", "--dry-run"]) == 2
    assert "hf/weights.bin" in capsys.readouterr().err
    assert (tmp_path / "run" / "hf" / "weights.bin").read_text() == "mine"


# --- checkpoints are data --------------------------------------------------------------------------------


def _payload_file(path: Path, marker: Path) -> Path:
    return write_pickle_payload(path, marker)


def test_the_pickle_payload_runs_code_unless_loads_are_weights_only(tmp_path: Path) -> None:
    """The test can fail: a plain unpickling of the file creates the marker. Inside weights_only_loads,
    the same call (DeepSpeed passes weights_only=False) is refused, names the file, and no marker appears."""
    path = _payload_file(tmp_path / "mp_rank_00_model_states.pt", tmp_path / "marker")
    with weights_only_loads(), pytest.raises(UnsafeCheckpoint, match="mp_rank_00_model_states.pt"):
        torch.load(path, weights_only=False)
    assert not (tmp_path / "marker").exists()
    assert "pathlib" in (file_problem(path) or "")  # found by reading the opcodes only
    assert not (tmp_path / "marker").exists()
    torch.load(path, weights_only=False)
    assert (tmp_path / "marker").exists()


def test_deepspeed_state_and_rng_state_load_weights_only(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum(1)}, tmp_path / "optim.pt")
    assert file_problem(tmp_path / "optim.pt") is None
    with weights_only_loads():
        assert torch.load(tmp_path / "optim.pt", weights_only=False)["zero_stage"] == ZeroStageEnum(1)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))  # plain weights-only: no objects
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


@pytest.mark.parametrize("text", ["../../..", "/etc", "step-1/../..", ".hidden", "", "a b", "x" * 300])
def test_latest_and_tags_are_single_plain_names(tmp_path: Path, text: str) -> None:
    (tmp_path / LATEST).write_text(text)
    with pytest.raises(UserError):
        read_latest(tmp_path)
    with pytest.raises(UserError):
        check_tag(text, "--tag")


def test_export_refuses_a_tag_that_leaves_the_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LATEST).write_text("../../..")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--tag", "../x"]) == 2
    assert not (tmp_path / "out").exists()


def _tag(ckpt: Path, step: int, world: int = 2) -> Path:
    """A tag as dsx3d writes it: per-rank file lists with sizes, over real torch files."""
    tag_dir = ckpt / tag_for(step)
    write_atomic(tag_dir / "dsx3d_layout.json", json.dumps({"dp": 1, "tp": 1, "pp": world, "world_size": world}))
    for rank in range(world):
        name = f"layer_{rank:02d}-model_00-model_states.pt"
        torch.save({"w": torch.ones(64)}, tag_dir / name)
        sizes = {name: (tag_dir / name).stat().st_size}
        write_atomic(files_path(tag_dir, rank), json.dumps({"rank": rank, "files": sizes}))
    return tag_dir


def test_a_damaged_latest_is_named_and_the_previous_complete_tag_chosen(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _tag(tmp_path, step)
    write_atomic(tmp_path / LATEST, tag_for(6))
    assert choose_tag(tmp_path) == (tag_for(6), [])
    victim = tmp_path / tag_for(6) / "layer_01-model_00-model_states.pt"
    victim.write_bytes(victim.read_bytes()[:-100])  # truncated
    (tmp_path / tag_for(4) / "files" / "rank-00001.json").unlink()  # a save that never finished
    tag, notes = choose_tag(tmp_path)
    assert tag == tag_for(2)
    assert f"{victim}: " in notes[0] and "truncated" in notes[0]
    assert "rank 1 did not finish" in notes[1] and "resuming from step-000002 instead" in notes[2]
    (tmp_path / tag_for(2) / "layer_00-model_00-model_states.pt").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(UserError, match="step-000002"):
        choose_tag(tmp_path)


def test_a_payload_in_a_tag_makes_it_damaged_without_running(tmp_path: Path) -> None:
    tag_dir = _tag(tmp_path, 2)
    target = tag_dir / "layer_00-model_00-model_states.pt"
    _payload_file(target, tmp_path / "marker")
    write_atomic(files_path(tag_dir, 0), json.dumps({"rank": 0, "files": {target.name: target.stat().st_size}}))
    problems = tag_problems(tag_dir)
    assert len(problems) == 1 and "weights-only load refuses" in problems[0]
    assert not (tmp_path / "marker").exists()


# --- resuming at another layout ------------------------------------------------------------------------


def _plan(saved: SavedLayout, old: dict, new: dict, layout: Layout, bounds: list[int]):
    base = yaml.safe_load(TINY.read_text())

    def recipe(patch: dict):
        data = json.loads(json.dumps(base))
        for section, values in patch.items():
            data[section].update(values)
        return recipe_from_dict(data)

    return plan_resume("step-000004", saved, recipe(old), recipe(new), layout, bounds)


def test_resume_plans() -> None:
    saved = SavedLayout(dp=2, tp=2, pp=2, bounds=[0, 3, 7])
    same = Layout(dp=2, tp=2, pp=2, gpus_per_node=8)
    assert not _plan(saved, {}, {}, same, [0, 3, 7]).reshard
    # tp 2 -> 1: resharded; another stage split at the same degrees: resharded too
    plan = _plan(saved, {}, {"parallel": {"tp": 1}, "cluster": {"gpus_per_node": 4}}, Layout(2, 1, 2, 4), [0, 3, 7])
    assert plan.reshard and "resharding" in plan.notes[0]
    assert _plan(saved, {}, {}, same, [0, 4, 7]).reshard
    # dp 2 -> 1 with twice the accumulation: the same samples per step, resharded
    halved = {"parallel": {"dp": 1}, "train": {"gradient_accumulation_steps": 8}, "cluster": {"gpus_per_node": 4}}
    assert _plan(saved, {}, halved, Layout(1, 2, 2, 4), [0, 3, 7]).reshard
    # a changed lr is reported: the restored optimizer and schedule continue
    assert "train.lr changed" in _plan(saved, {}, {"train": {"lr": 1.0e-3}}, same, [0, 3, 7]).notes[0]


@pytest.mark.parametrize(
    ("new", "layout", "words"),
    [
        ({"train": {"seq_len": 32}}, Layout(2, 2, 2, 8), "train.seq_len"),
        ({"parallel": {"dp": 1}, "cluster": {"gpus_per_node": 4}}, Layout(1, 2, 2, 4), "global batch"),
        ({"train": {"seed": 7}}, Layout(2, 2, 2, 8), "train.seed"),
        ({"zero": {"stage": 0}, "parallel": {"tp": 1}, "cluster": {"gpus_per_node": 4}}, Layout(2, 1, 2, 4), "ZeRO"),
    ],
    ids=["seq-len", "global-batch", "seed", "zero0-reshard"],
)
def test_resumes_that_cannot_be_exact_say_why_before_loading(new: dict, layout: Layout, words: str) -> None:
    with pytest.raises(UserError, match=words):
        _plan(SavedLayout(dp=2, tp=2, pp=2, bounds=[0, 3, 7]), {}, new, layout, [0, 3, 7])


def test_resumes_across_engines_or_expert_splits_are_refused_before_loading() -> None:
    """pp = 1 checkpoints (regular engine) and pipeline ones name parameters differently; experts split over
    EP ranks have no universal form: both are refused with the reason, whatever else the resume changes."""
    saved = SavedLayout(dp=2, tp=2, pp=2, bounds=[0, 3, 7])
    flat = {"parallel": {"pp": 1, "dp": 4}, "cluster": {"gpus_per_node": 8}}
    with pytest.raises(UserError, match="regular engine"):
        _plan(saved, {}, flat, Layout(4, 2, 1, 8), [0, 7])
    with pytest.raises(UserError, match="expert"):
        _plan(SavedLayout(dp=2, tp=2, pp=2, bounds=[0, 3, 7], ep=2), {}, {}, Layout(2, 2, 2, 8), [0, 3, 7])
    assert not _plan(SavedLayout(dp=2, tp=2, pp=2, bounds=[0, 3, 7], ep=2), {}, {}, Layout(2, 2, 2, 8, ep=2), [0, 3, 7]).reshard


# --- a full disk ------------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs where the machine allows mounting one (root); skipped elsewhere."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_named_even_when_torch_only_says_unexpected_pos(small_tmpfs: Path) -> None:
    assert not disk_full(small_tmpfs)
    try:
        torch.save(torch.zeros(1 << 20), small_tmpfs / "big.pt")  # 4 MiB into 1 MiB
    except Exception as err:  # torch: "unexpected pos ..." with no errno
        reason = write_failure(small_tmpfs / "big.pt", err)
    assert reason.startswith("no space left on device"), reason
    (small_tmpfs / "big.pt").unlink()
    assert not disk_full(small_tmpfs) and list(small_tmpfs.iterdir()) == []  # the probe leaves nothing


def test_an_enospc_error_is_named(tmp_path: Path) -> None:
    assert write_failure(tmp_path / "x.pt", OSError(28, "No space left on device")).startswith("no space left")
    assert write_failure(tmp_path / "x.pt", RuntimeError("boom")) == "RuntimeError: boom"


# --- the owner and heartbeats -----------------------------------------------------------------------------


def test_an_owner_is_its_pid_and_start_time() -> None:
    me = Owner.me()
    assert me.alive() and Owner.parse(me.token()) == me
    assert not Owner(me.pid, me.started + 10, me.host).alive()  # a recycled pid is not the owner
    assert Owner.parse("garbage") is None


def test_a_rank_notices_its_owner_dying() -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        token = Owner(owner.pid, psutil.Process(owner.pid).create_time(), Owner.me().host).token()
        gone: list[Owner] = []
        watch_owner(token, interval_s=0.05, on_gone=gone.append)
        time.sleep(0.3)
        assert not gone
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 5
        while not gone and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone and gone[0].pid == owner.pid
    finally:
        owner.kill()


def test_a_stopped_peer_is_hung_a_dead_or_finished_one_is_not(tmp_path: Path) -> None:
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = Owner.me().host
    me = RankInfo(0, 4, 0, None, host, os.getpid())
    peers = [me, RankInfo(1, 4, 1, None, host, stopped.pid), RankInfo(2, 4, 2, None, host, dead.pid)]
    peers.append(RankInfo(3, 4, 3, None, host, os.getpid()))
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the signal is delivered asynchronously
        while psutil.Process(stopped.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        beat_file(tmp_path, 3).write_text("done\n")
        now = time.time()
        assert hung_peers(tmp_path, me, peers, timeout_s=5, since=now) == []  # not silent long enough
        hung = hung_peers(tmp_path, me, peers, timeout_s=5, since=now - 10, now=now)
        assert [h.rank for h in hung] == [1] and hung[0].state == "stopped"
        assert f"pid {stopped.pid}" in hung[0].describe() and "no heartbeat for 10 s" in hung[0].describe()
        beat_file(tmp_path, 1).write_text(f"{now}\n")  # a fresh beat clears it
        assert hung_peers(tmp_path, me, peers, timeout_s=5, since=now - 10, now=now + 1) == []
    finally:
        stopped.kill()


# --- bad command lines: each a usage error or a UserError, exit 2, nothing written ----------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--world-size", "1000000000", "--tp", "1", "--pp", "1"],
        ["plan", "--dp", "131072", "--tp", "1024", "--pp", "8"],
        ["estimate", "--params", "nan"],
        ["estimate", "--params", "inf"],
        ["estimate", "--params", "7B", "--layers", "100000000", "--pp", "2"],
        ["plan", str(TINY), "--svg", "OUT/plan.txt"],
        ["config", str(TINY), "-o", "OUT"],
        ["accelerate-config", str(TINY), "-o", "OUT/a.yaml", "--ds-config", "OUT/a.yaml"],
        ["verify", "--dp", "64", "--tp", "64", "--pp", "64"],
        ["verify", "--lr", "inf"],
        ["train", str(TINY), "--pg-timeout-s", "nan", "--dry-run"],
    ],
    ids=lambda a: " ".join(a[:2]) + " " + a[-1],
)
def test_bad_command_lines_exit_2_and_write_nothing(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.replace("OUT", str(out)) for a in argv]
    began = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    assert code == 2 and time.monotonic() - began < 30
    assert "Traceback" not in capsys.readouterr().err
    assert list(out.iterdir()) == []
