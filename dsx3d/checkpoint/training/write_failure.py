"""Why a checkpoint write failed, in words: a full disk is said as such even when torch hides the errno."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

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
