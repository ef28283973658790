"""Why a checkpoint write failed, in words: a full disk is said as such even when torch hides the errno."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from dsx3d.fsio import WRITE_ERRNOS

_PROBE_BYTES = 1 << 16


def disk_full(directory: Path) -> bool:
    """Whether a small write fails for lack of space where `directory` is (the probe is removed)."""
    while not directory.exists():
        directory = directory.parent
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".dsx3d-space-probe-")
    except OSError as err:
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as err:
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        Path(probe).unlink(missing_ok=True)


def write_failure(path: Path, err: BaseException) -> str:
    """Why writing `path` failed, in words. torch's zip writer loses the errno ("unexpected pos 832 vs
    726"), so a full disk is also recognised by probing the filesystem."""
    text = " ".join(str(err).split())[:200] or type(err).__name__
    if (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or disk_full(path.parent):
        return f"no space left on device (writing {path.name}: {text})"
    return f"{type(err).__name__}: {text}"


def mendable_write_failure(path: Path, err: BaseException) -> str | None:
    """Why writing `path` failed, when the user mends it outside dsx3d (a full disk or quota, a read-only or
    forbidden directory); None for any other error. torch's zip writer raises RuntimeError without an errno,
    so the filesystem under `path` is probed as well."""
    why = write_failure(path, err)
    if (isinstance(err, OSError) and err.errno in WRITE_ERRNOS) or why.startswith("no space"):
        return why
    where = next((d for d in (path, *path.parents) if d.is_dir()), None)
    if where is None:
        return None
    try:
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return f"read-only file system under {where} (writing {path.name}: {why})"
    except OSError:
        return None
    if not os.access(where, os.W_OK):
        return f"permission denied: {where} is not writable (writing {path.name}: {why})"
    return None
