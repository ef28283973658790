"""The on-disk cache for trained tokenizers and tokenized corpora.

Every entry is named by a hash of everything it depends on, so a changed input is a new entry and a stale
one is never read. Entries appear atomically (written under a temporary name, then renamed): several ranks
or nodes may prepare the same entry at once, and a crash never leaves a half-written file to be reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


def default_cache_dir() -> Path:
    """$DSX3D_CACHE_DIR, else $XDG_CACHE_HOME/dsx3d, else ~/.cache/dsx3d."""
    if os.environ.get("DSX3D_CACHE_DIR"):
        return Path(os.environ["DSX3D_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsx3d"


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts (16 hex digits: collisions are not a concern here)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary file next to `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes `final` when the block succeeds.

    If another process created `final` first, its copy wins and ours is discarded: entries with the same
    name have the same content by construction.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
