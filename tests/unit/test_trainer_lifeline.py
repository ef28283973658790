"""dsx3d.Trainer's side of the lifeline: the launchers above a rank are found and watched, a hung peer is named
and killed, a launcher's end stops the ranks as a signal does (once), and a failed write the user can mend is
recognised even when torch drops the errno. The whole path runs in the campaign's Trainer face
(scripts/faults/trainer_face.py: sigkill-launcher, sigstop-rank, full-disk, unwritable)."""

from __future__ import annotations

import ast
import errno
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from dsx3d.checkpoint.training.write_failure import mendable_write_failure
from dsx3d.integrations import trainer_peers, trainer_preempt
from dsx3d.run import lifeline
from dsx3d.run.lifeline import Hung, Owner, hung_marker, watching_launchers
from dsx3d.run.preempt import StopRequest
from dsx3d.run.ranks import RankInfo


def _owner(proc: subprocess.Popen[bytes]) -> Owner:
    return Owner(proc.pid, psutil.Process(proc.pid).create_time(), "here")


def test_the_launcher_chain_is_the_python_processes_above_nearest_first() -> None:
    inner = "from dsx3d.run.lifeline import launcher_chain; print([o.pid for o, _ in launcher_chain()])"
    outer = f"import os, subprocess, sys; print(os.getpid()); subprocess.run([sys.executable, '-c', {inner!r}])"
    lines = subprocess.run([sys.executable, "-c", outer], capture_output=True, text=True, check=True).stdout.split("\n")
    outer_pid, chain = int(lines[0]), ast.literal_eval(lines[1])
    assert chain[:2] == [outer_pid, os.getpid()]  # the outer script, then this test's process


def test_a_launcher_that_ends_is_reported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(lifeline, "launcher_chain", lambda: [(_owner(sleeper), "sleeper")])
    gone: list[tuple[int, str]] = []
    seen = threading.Event()

    def on_gone(owner: Owner, cmd: str) -> None:
        gone.append((owner.pid, cmd))
        seen.set()

    with watching_launchers(on_gone, interval_s=0.05):
        assert not seen.wait(0.3)  # alive: nothing said
        sleeper.kill()
        sleeper.wait()
        assert seen.wait(5)
    assert gone == [(sleeper.pid, "sleeper")]


def test_a_launcher_that_ends_after_the_last_look_is_named_at_exit_and_only_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer face's sigkill-launcher at step 20 of 24: training finished within the watch's interval."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(lifeline, "launcher_chain", lambda: [(_owner(sleeper), "sleeper")])
    during: list[int] = []
    at_exit: list[int] = []
    with watching_launchers(lambda o, _: during.append(o.pid), interval_s=30, on_gone_at_exit=lambda o, _: at_exit.append(o.pid)):
        sleeper.kill()
        sleeper.wait()
    assert (during, at_exit) == ([], [sleeper.pid])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with watching_launchers(lambda o, _: during.append(o.pid), interval_s=30, on_gone_at_exit=lambda o, _: at_exit.append(o.pid)):
        pass
    sleeper.kill()
    sleeper.wait()
    assert len(at_exit) == 1  # alive at exit: nothing more said


def test_a_launchers_end_is_a_stop_request_but_never_a_second_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exits: list[int] = []
    callback = trainer_preempt.PreemptionCallback()
    callback.stop = StopRequest(exit_now=exits.append)
    with caplog.at_level("WARNING", logger="dsx3d"):
        callback.launcher_gone()
    assert callback.stop.signum == signal.SIGTERM and exits == []
    assert "the launcher has ended: finishing this step" in caplog.text
    callback.launcher_gone()  # noticed again: nothing more
    assert exits == []
    agreed = trainer_preempt.PreemptionCallback()
    agreed.stop = StopRequest(exit_now=exits.append)
    agreed.preempted = (signal.SIGUSR1, 7, tmp_path / "checkpoint-7")  # the ranks agreed on a peer's signal
    agreed.launcher_gone()
    assert agreed.stop.signum is None and exits == []  # the stop goes on: not a second signal
    with caplog.at_level("WARNING", logger="dsx3d"):
        agreed.on_save(None, SimpleNamespace(global_step=7), None)
    assert agreed.stop.stopped_at == 7  # saved: a signal from here on only ends the rank
    assert f"stopped by SIGUSR1 after step 7: checkpoint {tmp_path / 'checkpoint-7'} saved" in caplog.text
    import dsx3d.integrations.script_errors as script_errors

    monkeypatch.setattr(script_errors, "exit_now", exits.append)
    off = trainer_preempt.PreemptionCallback(enabled=False)
    off.on_train_begin(None, None, None)
    assert off.stop is None and not off.installed  # train.save_on_signal false: the signals' own handlers
    off.launcher_gone()
    assert exits == [1]  # and a launcher's end stops at once


def test_the_peer_that_finds_a_hung_rank_names_it_kills_it_and_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(stopped.pid, signal.SIGSTOP)
    me = RankInfo(0, 2, 0, 0, "here", os.getpid())
    peer = RankInfo(1, 2, 1, 0, "here", stopped.pid)
    exits: list[int] = []
    monkeypatch.setattr(trainer_peers, "exit_now", exits.append)
    with caplog.at_level("ERROR", logger="dsx3d"):
        trainer_peers._killing_hung([me, peer])(tmp_path, me, [Hung(1, peer.where(), 12.0, "stopped")])
    assert stopped.wait(5) == -signal.SIGKILL and exits == [1]
    assert f"{peer.where()} is hung: no heartbeat for 12 s" in caplog.text
    assert f"killed the hung {peer.where()}" in caplog.text
    assert "is hung" in hung_marker(tmp_path, 1).read_text()  # peers that stop later name it too


def test_a_write_the_user_can_mend_is_recognised_without_its_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ckpt" / "scheduler.pt"
    read_only = OSError(errno.EROFS, "Read-only file system", str(target))
    assert "Read-only file system" in (mendable_write_failure(target, read_only) or "")
    torch_like = RuntimeError("[enforce fail at inline_container.cc:747] . open file failed")
    assert mendable_write_failure(target, torch_like) is None  # a writable directory: a defect, raised
    real_statvfs = os.statvfs

    class _ReadOnly:
        def __init__(self, st: Any) -> None:
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: _ReadOnly(real_statvfs(p)))
    said = mendable_write_failure(target, torch_like) or ""
    assert said.startswith(f"read-only file system under {tmp_path}") and "scheduler.pt" in said


def test_deepspeeds_latest_is_written_through_the_saves_record(tmp_path: Path) -> None:
    """A read-only directory at the moment DeepSpeed wrote `latest` (rank 0 only, just before its closing
    barrier) raised past that barrier: rank 1 waited there and rank 0 in the manifest's exchange, for ever (the
    Trainer face's unwritable at step 4 + 0.08 s). The write now goes through the record, like every other."""
    from dsx3d.checkpoint.training.checkpointer import _SaveLog
    from dsx3d.integrations.trainer_saving import SavingMixin

    calls: list[dict[str, Any]] = []
    ds_engine = SimpleNamespace(global_steps=4, save_checkpoint=lambda d, **kw: calls.append({"dir": d, **kw}))
    trainer = SimpleNamespace(_engine=lambda: SimpleNamespace(ds_engine=ds_engine), args=SimpleNamespace(should_save=False))
    trainer._save_log = _SaveLog(tmp_path)
    SavingMixin._save_optimizer_and_scheduler(trainer, str(tmp_path))  # type: ignore[arg-type]
    assert calls == [{"dir": str(tmp_path), "tag": "global_step4", "save_latest": False}]
    assert (tmp_path / "latest").read_text() == "global_step4" and "latest" in trainer._save_log.sums
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # a write that fails
    trainer._save_log = _SaveLog(tmp_path)
    SavingMixin._save_optimizer_and_scheduler(trainer, str(tmp_path))  # type: ignore[arg-type]
    assert [p for p, _ in trainer._save_log.failed] == [str(tmp_path / "latest")]  # recorded, not raised


def test_the_process_group_is_destroyed_at_exit_before_the_interpreter_finalizes(tmp_path: Path) -> None:
    """Left to finalization, gloo's threads can abort a rank that finished (exit -6, "terminate called without
    an active exception"); the Trainer's set-up registers the group's destruction at exit, once however often."""
    script = """
import atexit
import torch.distributed as dist
from dsx3d.distributed import comm
calls = []
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), "destroyed", len(calls), "times"))
destroy = comm.destroy
comm.destroy = lambda: (calls.append(1), destroy())
from dsx3d.integrations.trainer_setup import _ensure_process_group
_ensure_process_group()
_ensure_process_group()  # a second Trainer in the same script
print("initialized:", dist.is_initialized())
"""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-2:] == ["initialized: True", "initialized at exit: False destroyed 1 times"]
