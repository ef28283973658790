"""Writing files and directories so that a crash never leaves half of one, and colleagues can read them.

Every file dsx3d writes goes through `write_atomic` (a temporary file in the same directory, fsync, rename
over the target) and every directory it produces as a whole (an HF export, a cache entry, a universal
checkpoint) through `staging_dir` + `publish_dir`. Modes are explicit: `mkstemp` and `mkdtemp` create 0600
and 0700, which on a shared cluster would hide a run's files and its exported model from everyone else.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""The errors of a write the user mends outside dsx3d: a full disk or quota, a read-only or forbidden directory."""

FILE_MODE = 0o644
DIR_MODE = 0o755


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable. Some filesystems refuse to fsync a directory; the rename
    itself is what readers see, so that is not an error."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(
    path: str | Path, data: str | bytes | Callable[[IO[bytes]], None], *, mode: int = FILE_MODE, fsync: bool = True
) -> Path:
    """Write `data` (text, bytes, or a function that writes into a binary file object) to `path`: readers
    see the old content or the new one, never a mix, even if the writer dies. No temporary file is left
    behind on failure (a full disk included)."""
    target = Path(path)
    make_dirs(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{_temp_stem(target.name)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(target.parent)
    return target


def make_dirs(path: str | Path, *, mode: int = DIR_MODE) -> Path:
    """mkdir -p with an explicit mode for the directories it creates (the umask does not narrow it)."""
    target = Path(path)
    missing = []
    p = target
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
            os.chmod(d, mode)
    return target


def staging_dir(final: str | Path) -> Path:
    """A fresh, empty directory beside `final` (same filesystem, so publishing is a rename)."""
    final = Path(final)
    make_dirs(final.parent)
    return Path(tempfile.mkdtemp(prefix=f".{_temp_stem(final.name)}.tmp-", dir=final.parent))


def share_tree(
    root: str | Path, *, recursive: bool = True, dir_mode: int = DIR_MODE, file_mode: int = FILE_MODE
) -> None:
    """Give `root` (a file or a directory, with its files and, if `recursive`, its whole tree) explicit
    modes: for what libraries wrote with the process umask (DeepSpeed's checkpoint files, a tokenizer's
    save_pretrained, a plot). Executable files stay executable (0755). Files another user owns are left."""
    root = Path(root)
    if not root.exists():
        return
    entries = [root] if root.is_file() else [root, *(root.rglob("*") if recursive else root.iterdir())]
    for path in entries:
        with contextlib.suppress(PermissionError, FileNotFoundError):
            if path.is_dir():
                if path == root or recursive:
                    os.chmod(path, dir_mode)
            else:
                executable = path.stat().st_mode & 0o100
                os.chmod(path, dir_mode if executable else file_mode)


def publish_dir(
    staging: Path, final: str | Path, *, replace: bool = True, dir_mode: int = DIR_MODE, file_mode: int = FILE_MODE
) -> Path:
    """Move the finished `staging` directory to `final` with explicit modes. An existing `final` is replaced
    when `replace` (it is renamed aside first, then removed, so `final` is never half old, half new);
    otherwise the existing one wins and `staging` is discarded (for content-addressed cache entries)."""
    final = Path(final)
    share_tree(staging, dir_mode=dir_mode, file_mode=file_mode)
    if final.exists() and not replace:
        shutil.rmtree(staging, ignore_errors=True)
        return final
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(staging, final)
        except OSError:
            if replace or not final.is_dir():
                raise
            shutil.rmtree(staging, ignore_errors=True)  # another process published the same entry first
    fsync_dir(final.parent)
    return final


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging directory that becomes `final` when the block succeeds; on failure it is
    removed and `final` is untouched."""
    staging = staging_dir(final)
    try:
        yield staging
        publish_dir(staging, final, replace=replace)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)

NAME_MAX = 255
"""Bytes in one path component that Linux's file systems allow (ext4, xfs, btrfs, tmpfs; limits.h)."""
PATH_MAX = 4096
"""Bytes in a whole path that Linux's system calls accept."""
TEMP_STEM = 200
"""Bytes of a target's name kept in the names of its temporary files and staging directories, so that a
target whose name fits NAME_MAX gets temporary names that fit too (a dot, 8 random characters, a suffix)."""


def name_problem(path: str | Path) -> str | None:
    """Why the system would refuse `path` as too long (None when it would not), said before any file call
    fails with ENAMETOOLONG: a component over NAME_MAX bytes, or the whole over PATH_MAX."""
    raw = os.fsencode(Path(path).expanduser())
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > NAME_MAX:
        return f"has a name of {longest} bytes, and file systems allow {NAME_MAX}"
    if len(raw) >= PATH_MAX:
        return f"is {len(raw)} bytes long, and the system allows {PATH_MAX - 1}"
    return None


def _temp_stem(name: str) -> str:
    stem = name[:TEMP_STEM]
    while len(os.fsencode(stem)) > TEMP_STEM:  # multi-byte characters
        stem = stem[:-1]
    return stem


def output_dir_problem(path: str | Path, *, cwd: Path | None = None, home: Path | None = None) -> str | None:
    """Why `path` must not be a run directory (None when it may): dsx3d writes into it and a fresh start
    clears its own files there, so it must be a directory of its own."""
    if not str(path).strip():
        return "is empty"
    too_long = name_problem(path)
    if too_long:
        return too_long
    try:
        target = Path(path).expanduser().resolve()
        cwd = (cwd or Path.cwd()).resolve()
        home = (home or Path.home()).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL byte
        return f"cannot be resolved ({err})"
    if target == Path(target.anchor):
        return "is the filesystem root"
    if len(target.parts) <= 2:
        return f"is the top-level directory {target}"
    if target == home or home.is_relative_to(target):
        return f"is the home directory {home} or one of its parents"
    if cwd.is_relative_to(target):
        return f"is the working directory {cwd} or one of its parents"
    if target.exists() and not target.is_dir():
        return "exists and is not a directory"
    return None
