"""Verified checkpoint manifests and the stop-signal logic, without processes: a corrupt, truncated or missing
file is named and skipped by --resume, refused by export and the universal conversion; a first signal asks
for a save, a second one (or the deadline) stops at once."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from dsx3d.checkpoint.checksums import digest, read_sums, sum_problems, write_sums
from dsx3d.checkpoint.training.disk_format import LATEST, files_path, foreign_files, tag_for
from dsx3d.checkpoint.training.tags import check_complete, choose_tag, tag_problems
from dsx3d.errors import UserError
from dsx3d.fsio import write_atomic
from dsx3d.run.preempt import StopRequest, preempted_message
from dsx3d.run.relay import SignalRelay, is_rank_command


def _tag(ckpt: Path, step: int, world: int = 2) -> Path:
    """A tag as dsx3d writes it now: per-rank file lists (format 2), real torch files, the manifest last."""
    tag_dir = ckpt / tag_for(step)
    write_atomic(tag_dir / "dsx3d_layout.json", json.dumps({"dp": 1, "tp": 1, "pp": world, "world_size": world}))
    sums = {"dsx3d_layout.json": digest(tag_dir / "dsx3d_layout.json")}
    for rank in range(world):
        name = f"layer_{rank:02d}-model_00-model_states.pt"
        torch.save({"w": torch.arange(4096, dtype=torch.float32) * (step + rank)}, tag_dir / name)
        write_atomic(files_path(tag_dir, rank), json.dumps({"rank": rank, "files": {name: 0}, "format": 2}))
        for p in (tag_dir / name, files_path(tag_dir, rank)):
            sums[p.relative_to(tag_dir).as_posix()] = digest(p)
    write_sums(tag_dir, sums)
    return tag_dir


def _flip_a_tensor_bit(path: Path) -> None:
    """One bit of the tensor data: the zip and its pickle stay intact (the old checks pass it)."""
    raw = bytearray(path.read_bytes())
    at = raw.rfind(b"\x00\x00\x80\x45")  # float 4096.0 * k lies in the data region; any data byte would do
    at = at if at > 0 else len(raw) // 2
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_complete_tag_has_no_problems_and_its_manifest_is_a_dsx3d_file(tmp_path: Path) -> None:
    tag_dir = _tag(tmp_path, 2)
    assert tag_problems(tag_dir) == []
    assert set(read_sums(tag_dir) or {}) == {p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_file()} - {"dsx3d_checkpoint.json"}
    assert foreign_files(tmp_path) == []  # pruning and --overwrite may delete it


@pytest.mark.parametrize("fault", ["bitflip", "truncated", "missing", "no-manifest", "extra-bytes"])
def test_a_damaged_file_is_named(tmp_path: Path, fault: str) -> None:
    tag_dir = _tag(tmp_path, 2)
    victim = tag_dir / "layer_01-model_00-model_states.pt"
    if fault == "bitflip":
        _flip_a_tensor_bit(victim)
    elif fault == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif fault == "missing":
        victim.unlink()
    elif fault == "extra-bytes":
        victim.write_bytes(victim.read_bytes() + b"\0")
    else:
        (tag_dir / "dsx3d_checkpoint.json").unlink()
    problems = tag_problems(tag_dir)
    named = tag_dir / "dsx3d_checkpoint.json" if fault == "no-manifest" else victim
    assert len(problems) == 1 and problems[0].startswith(f"{named}: "), problems
    words = {"bitflip": "checksum differs", "truncated": "truncated", "missing": "missing", "extra-bytes": "bytes"}
    assert words.get(fault, "did not finish") in problems[0]


def test_resume_skips_a_corrupt_latest_and_names_the_file(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _tag(tmp_path, step)
    write_atomic(tmp_path / LATEST, tag_for(6))
    victim = tmp_path / tag_for(6) / "layer_00-model_00-model_states.pt"
    _flip_a_tensor_bit(victim)
    (tmp_path / tag_for(4) / "dsx3d_checkpoint.json").unlink()  # a save that died before its manifest
    tag, notes = choose_tag(tmp_path)
    assert tag == tag_for(2)
    assert str(victim) in notes[0] and "corrupt" in notes[0]
    assert "dsx3d_checkpoint.json: missing" in notes[1] and "resuming from step-000002 instead" in notes[2]
    _flip_a_tensor_bit(tmp_path / tag_for(2) / "layer_01-model_00-model_states.pt")
    with pytest.raises(UserError, match="step-000002"):  # nothing complete is left: exit 2, no traceback
        choose_tag(tmp_path)


def test_export_and_universal_conversion_refuse_a_corrupt_tag(tmp_path: Path) -> None:
    from dsx3d.checkpoint.hf.offline_export import resolve_tag_dir
    from dsx3d.checkpoint.training.universal import to_universal

    tag_dir = _tag(tmp_path, 2)
    write_atomic(tmp_path / LATEST, tag_for(2))
    assert resolve_tag_dir(tmp_path) == tag_dir
    check_complete(tag_dir, "CHECKPOINT_DIR")
    victim = tag_dir / "layer_00-model_00-model_states.pt"
    _flip_a_tensor_bit(victim)
    for call in (lambda: resolve_tag_dir(tmp_path), lambda: resolve_tag_dir(tag_dir), lambda: to_universal(tag_dir, tmp_path / "u")):
        with pytest.raises(UserError) as err:
            call()
        assert str(victim) in str(err.value) and "corrupt" in str(err.value)
    assert not (tmp_path / "u").exists()


def test_a_manifest_naming_a_path_outside_the_tag_is_a_problem(tmp_path: Path) -> None:
    tag_dir = _tag(tmp_path, 2)
    write_sums(tag_dir, {"../../etc/passwd": (1, "0")})
    assert "outside the tag" in sum_problems(tag_dir)[0]


# --- stop signals ----------------------------------------------------------------------------------------


class _Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def test_a_first_signal_asks_for_a_save_and_a_second_stops_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _tag(tmp_path, 4)
    write_atomic(tmp_path / LATEST, tag_for(4))
    exits = _Exits()
    stop = StopRequest(ckpt_dir=tmp_path, exit_now=exits)
    with stop.installed(), caplog.at_level("WARNING", logger="dsx3d"):
        signal.raise_signal(signal.SIGUSR1)
        assert (stop.signum, exits.codes) == (signal.SIGUSR1, [])
        assert "SIGUSR1 received: finishing this step" in caplog.text
        signal.raise_signal(signal.SIGTERM)
        assert exits.codes == [128 + signal.SIGTERM]
    assert "a second signal (SIGTERM): stopping at once" in caplog.text
    assert f"the last complete checkpoint {tmp_path / tag_for(4)} is kept" in caplog.text
    assert signal.getsignal(signal.SIGUSR1) is not stop._handle  # the handlers are given back


def test_the_deadline_stops_at_once_unless_the_save_finished(caplog: pytest.LogCaptureFixture) -> None:
    exits = _Exits()
    stop = StopRequest(deadline_s=0.05, exit_now=exits)
    stop.request(signal.SIGTERM)
    time.sleep(0.3)
    assert exits.codes == [128 + signal.SIGTERM]
    assert "train.signal_deadline_s = 0.05 s passed since SIGTERM" in caplog.text
    saved = StopRequest(deadline_s=0.05, exit_now=(exits := _Exits()))
    saved.request(signal.SIGTERM)
    saved.cancel()
    time.sleep(0.3)
    assert exits.codes == []


def test_after_the_save_a_signal_only_ends_the_rank_saying_the_save(caplog: pytest.LogCaptureFixture) -> None:
    """The launcher ends the slower ranks with SIGTERM once one rank exits: not a 'second signal'. The rank says
    the stop and its step itself: the one that would have said it may be ended first (the Trainer face's
    sigterm-twice: rank 1 ended by the second signal, rank 0 then saying only that rank 1 died)."""
    exits = _Exits()
    stop = StopRequest(exit_now=exits)
    stop.agreed_signal, stop.stopped_at = signal.SIGUSR1, 6
    with caplog.at_level("WARNING", logger="dsx3d"):
        stop.request(signal.SIGTERM)
    assert exits.codes == [128 + signal.SIGUSR1] and "stopping at once" not in caplog.text
    assert "stopped by SIGUSR1 after step 6: its checkpoint is saved (SIGTERM ended this rank" in caplog.text


def test_a_peer_ending_during_a_stop_is_said_as_the_stop(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """The second SIGTERM ends rank 1 while rank 0 waits in a collective, where its handler cannot run: rank 0
    sees only rank 1's end (the Trainer face's sigterm-twice #7 of 20, seed 36), and says the stop at once, on
    any rank. Without a stop under way a peer's end is left to the caller (exit 1 and its message)."""
    exits = _Exits()
    stop = StopRequest(ckpt_dir=tmp_path, loud=False, exit_now=exits)
    stop.peer_ended("rank 0 stopped: rank 1 died")
    assert exits.codes == []
    stop.request(signal.SIGTERM)
    with caplog.at_level("WARNING", logger="dsx3d"):
        stop.peer_ended("rank 0 stopped: rank 1 died")
    assert exits.codes == [128 + signal.SIGTERM]
    assert "rank 1 died, after SIGTERM asked for a stop (a second signal ends a rank at once): stopping at once" in caplog.text
    stop.stopped_at, stop.agreed_signal = 8, signal.SIGTERM
    caplog.clear()
    with caplog.at_level("WARNING", logger="dsx3d"):
        stop.peer_ended("rank 0 stopped: rank 1 died")
    assert exits.codes[-1] == 128 + signal.SIGTERM and "stopping at once" not in caplog.text
    assert "stopped by SIGTERM after step 8: its checkpoint is saved (rank 0 stopped: rank 1 died on the way out)" in caplog.text


def test_the_messages_name_the_signal_and_the_checkpoint(tmp_path: Path) -> None:
    text = preempted_message(signal.SIGTERM, 12, tmp_path / tag_for(12), "r.yaml")
    assert text == f"stopped by SIGTERM after step 12: checkpoint {tmp_path / tag_for(12)} saved; continue with dsx3d train r.yaml --resume"
    relay = SignalRelay(launcher_pid=-1, save_on_signal=True)
    relay.received, relay.saving, relay.first_at = [signal.SIGHUP], True, time.monotonic()
    message, code = relay.outcome(128 + signal.SIGTERM) or ("", 0)
    assert "stopped (SIGHUP)" in message and "after saving a checkpoint" in message and code == 128 + signal.SIGHUP
    assert SignalRelay(-1, True).outcome(0) is None


def test_a_deletion_a_kill_interrupted_is_finished_by_the_next_prune(tmp_path: Path) -> None:
    from dsx3d.checkpoint.training.tags import prune

    for step in (2, 4, 6):
        _tag(tmp_path, step)
    write_atomic(tmp_path / LATEST, tag_for(6))
    (tmp_path / tag_for(2)).rename(tmp_path / f".deleting-{tag_for(2)}")  # killed right after the rename
    (tmp_path / f".deleting-{tag_for(2)}" / "layer_00-model_00-model_states.pt").unlink()  # and one file
    assert prune(tmp_path, keep=2) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, tag_for(4), tag_for(6)]


def test_the_owner_signals_the_ranks_and_not_the_launchers_agent() -> None:
    """The agent's command line names `--module dsx3d.train` too; signalled, it would SIGTERM every rank."""
    agent = ["python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--module", "dsx3d.train", "r.yaml"]
    rank = ["/venv/bin/python", "-u", "-m", "dsx3d.train", "r.yaml", "--overwrite", "--local_rank=0"]
    assert is_rank_command(rank) and not is_rank_command(agent)
    assert not is_rank_command(["python", "-m"]) and not is_rank_command(["dsx3d", "train", "dsx3d.train"])


def test_hashing_while_torch_saves_equals_reading_the_file_back(tmp_path: Path) -> None:
    from dsx3d.checkpoint.checksums import save_hashed

    path = tmp_path / "x.pt"
    got = save_hashed(lambda f: torch.save({"w": torch.arange(100_000.0)}, f), path)
    assert got == digest(path) and got[0] == path.stat().st_size
    assert torch.equal(torch.load(path, weights_only=True, mmap=True)["w"], torch.arange(100_000.0))


def test_a_signal_that_arrives_as_the_job_finishes_reports_a_completed_run() -> None:
    relay = SignalRelay(launcher_pid=1, save_on_signal=True)
    relay.received, relay.first_at, relay.saving = [signal.SIGTERM], time.monotonic(), True
    message, code = relay.outcome(0)
    assert code == 0 and "completed every step" in message
    assert relay.outcome(128 + signal.SIGTERM)[1] == 128 + signal.SIGTERM


def test_the_ranks_of_a_killed_launcher_are_ended_and_named(capsys: pytest.CaptureFixture[str]) -> None:
    """The launcher's process group outlives a SIGKILLed leader; whatever of it is left after the grace is
    killed, and the message names the launcher and the signal."""
    import os
    import subprocess

    from dsx3d.run.relay import end_orphaned_job, group_processes

    leader = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    deadline = time.monotonic() + 5
    while len(group_processes(leader.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    assert group_processes(leader.pid), "the sleeps outlive their leader"
    end_orphaned_job(leader.pid, -signal.SIGKILL, grace_s=0.3)
    deadline = time.monotonic() + 5
    while group_processes(leader.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_processes(leader.pid) == []
    assert f"launcher (pid {leader.pid}) was killed by SIGKILL" in capsys.readouterr().err


def test_a_failed_write_is_said_with_the_file_and_the_remedy() -> None:
    import errno

    from dsx3d.run.ranks import WRITE_ERRNOS, RankInfo, write_failure_message

    info = RankInfo(rank=0, world_size=2, local_rank=0, launcher_node=0, host="h", pid=1)
    err = OSError(errno.ENOSPC, "No space left on device", "/run/x/loss.png")
    assert err.errno in WRITE_ERRNOS
    text = write_failure_message(info, err)
    assert "cannot write /run/x/loss.png: no space left on device" in text and "--resume" in text


def test_a_resume_past_a_damaged_tag_sets_it_aside_so_pruning_keeps_the_complete_one(tmp_path: Path) -> None:
    from dsx3d.checkpoint.training.tags import prune, set_aside_damaged

    for step in (20, 23):
        _tag(tmp_path, step)
    write_atomic(tmp_path / LATEST, tag_for(23))
    (tmp_path / tag_for(23) / "layer_01-model_00-model_states.pt").unlink()
    tag, _ = choose_tag(tmp_path)
    assert tag == tag_for(20)
    assert "moved the damaged" in set_aside_damaged(tmp_path, tag)[0]
    _tag(tmp_path, 24)  # the resumed run saves step 24
    write_atomic(tmp_path / LATEST, tag_for(24))
    assert prune(tmp_path, keep=2) == []
    assert choose_tag(tmp_path)[0] == tag_for(24) and (tmp_path / tag_for(20)).is_dir()
    assert (tmp_path / f".damaged-{tag_for(23)}").is_dir()


def test_a_stopped_rank_is_killed_once_another_rank_has_ended(capsys: pytest.CaptureFixture[str]) -> None:
    """The owner's reaper: a stopped rank is left alone while every rank lives, and killed (seen stopped
    twice) once a peer has ended, so the launcher's 30 s grace for the stopped rank is not waited out."""
    import contextlib
    import os
    import subprocess
    import sys

    import psutil

    from dsx3d.run.relay import StoppedRankReaper, rank_processes, stopped_to_end

    rank = f"{sys.executable} -c 'import time; time.sleep(60)' -m dsx3d.train"  # a rank's command line
    launcher = subprocess.Popen(["sh", "-c", f"{rank} & {rank} & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(ranks := rank_processes(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped, other = ranks
        reaper = StoppedRankReaper(launcher.pid)
        assert reaper.poll() == []
        os.kill(stopped.pid, signal.SIGSTOP)
        while stopped.status() != psutil.STATUS_STOPPED:
            time.sleep(0.01)
        assert reaper.poll() == [] and reaper.poll() == []  # stopped, but no rank has ended: a debugger, say
        other.kill()
        while other.pid in {p.pid for p in rank_processes(launcher.pid)}:
            time.sleep(0.05)
        assert reaper.poll() == [stopped.pid]
        stopped.wait(5)  # not our child: psutil waits for it to go
        assert not stopped.is_running()
        assert f"rank process {stopped.pid} is stopped and another rank has ended" in capsys.readouterr().err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    # seen stopped only once: not yet (a process between a stop and a continue)
    assert stopped_to_end({1, 2}, {1: psutil.STATUS_STOPPED}, set()) == []
    assert stopped_to_end({1, 2}, {1: psutil.STATUS_STOPPED}, {1}) == [1]
    assert stopped_to_end({1}, {1: psutil.STATUS_STOPPED}, {1}) == []


def test_every_bit_flipped_in_a_manifest_is_found(tmp_path: Path) -> None:
    """The manifest checks itself: a flip in its file list, a size, a checksum, a key or the JSON is named,
    never resumed from (the file list is not among the sums, so without its own checksum a flip there passed)."""
    (tmp_path / "a.pt").write_bytes(b"weights")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text("{}")
    manifest = write_sums(tmp_path, {"a.pt": digest(tmp_path / "a.pt"), "sub/b.json": digest(tmp_path / "sub" / "b.json")})
    assert sum_problems(tmp_path) == []
    raw = manifest.read_bytes()
    missed = []
    for at in range(len(raw)):
        for bit in range(8):
            manifest.write_bytes(raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1 :])
            problems = sum_problems(tmp_path)
            if not problems:
                missed.append((at, bit, chr(raw[at])))
            else:
                assert problems[0].startswith(f"{manifest}: "), problems
    assert not missed, missed[:10]
    manifest.write_bytes(raw)
    assert sum_problems(tmp_path) == []


def test_a_manifest_written_before_it_checked_itself_is_still_read(tmp_path: Path) -> None:
    (tmp_path / "a.pt").write_bytes(b"weights")
    manifest = write_sums(tmp_path, {"a.pt": digest(tmp_path / "a.pt")})
    data = json.loads(manifest.read_text())
    del data["self"]
    manifest.write_text(json.dumps(data))
    assert sum_problems(tmp_path) == [] and read_sums(tmp_path) == {"a.pt": digest(tmp_path / "a.pt")}
