"""dsx3d.fsio: atomic writes and directory publishing with explicit modes, whatever the umask; nothing left
behind on failure."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsx3d import fsio


@pytest.fixture(autouse=True)
def private_umask() -> Iterator[None]:
    old = os.umask(0o077)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_atomic_is_readable_by_others_and_replaces_whole(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "config.json"
    fsio.write_atomic(target, "one")
    fsio.write_atomic(target, b"two")
    fsio.write_atomic(target, lambda f: f.write(b"three"))
    assert target.read_text() == "three"
    assert _mode(target) == 0o644 and _mode(target.parent) == 0o755 and _mode(tmp_path / "a") == 0o755
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    fsio.write_atomic(target, "step-000002")

    def full_disk(f: object) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        fsio.write_atomic(target, full_disk)
    assert target.read_text() == "step-000002"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_publish_dir_sets_modes_and_replaces_atomically(tmp_path: Path) -> None:
    final = tmp_path / "hf"
    for content in ("old", "new"):
        with fsio.atomic_dir(final) as staging:
            (staging / "sub").mkdir()
            (staging / "sub" / "model.safetensors").write_text(content)
    assert (final / "sub" / "model.safetensors").read_text() == "new"
    assert _mode(final) == 0o755 and _mode(final / "sub") == 0o755
    assert _mode(final / "sub" / "model.safetensors") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging or old copy left


def test_a_failed_publish_leaves_the_old_directory(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    with fsio.atomic_dir(final) as staging:
        (staging / "x").write_text("kept")
    with pytest.raises(RuntimeError), fsio.atomic_dir(final) as staging:
        (staging / "x").write_text("half")
        raise RuntimeError("writer died")
    assert (final / "x").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_cache_entries_keep_the_first_copy(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    with fsio.atomic_dir(final, replace=False) as staging:
        (staging / "x").write_text("first")
    with fsio.atomic_dir(final, replace=False) as staging:
        (staging / "x").write_text("second")
    assert (final / "x").read_text() == "first"


def test_share_tree_keeps_executables_executable(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o700)
    (tmp_path / "d" / "data.pt").write_text("x")
    script = tmp_path / "d" / "tool.py"
    script.write_text("x")
    script.chmod(0o700)
    fsio.share_tree(tmp_path / "d")
    assert _mode(tmp_path / "d") == 0o755 and _mode(tmp_path / "d" / "data.pt") == 0o644 and _mode(script) == 0o755


def test_a_name_that_fits_gets_temporary_names_that_fit(tmp_path: Path) -> None:
    """The CLI fuzz found a 250-byte name whose temporary file (".NAME.XXXXXXXX.tmp") went over NAME_MAX."""
    name = "é" * 120 + ".json"  # 245 bytes in UTF-8
    assert fsio.name_problem(tmp_path / name) is None
    fsio.write_atomic(tmp_path / name, "{}")
    assert [p.name for p in tmp_path.iterdir()] == [name]
    staging = fsio.staging_dir(tmp_path / ("d" * 255))
    assert staging.parent == tmp_path and len(os.fsencode(staging.name)) <= fsio.NAME_MAX


@pytest.mark.parametrize(
    "path, said",
    [("x" * 256, "a name of 256 bytes"), ("a/" + "é" * 128 + "/b", "a name of 256 bytes"), ("/".join(["d" * 200] * 21), "bytes long")],
)
def test_names_the_system_would_refuse_are_said_before_any_file_call(tmp_path: Path, path: str, said: str) -> None:
    assert said in (fsio.name_problem(tmp_path / path) or "")
    assert said in (fsio.output_dir_problem(tmp_path / path) or "")
    assert fsio.name_problem(tmp_path / ("x" * 255)) is None
