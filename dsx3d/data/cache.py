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
from pathlib import Path

import numpy as np

from dsx3d import fsio
from dsx3d.fsio import write_atomic


def default_cache_dir() -> Path:
    """$DSX3D_CACHE_DIR, else $XDG_CACHE_HOME/dsx3d, else ~/.cache/dsx3d."""
    if os.environ.get("DSX3D_CACHE_DIR"):
        return Path(os.environ["DSX3D_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsx3d"


def digest(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts (16 hex digits: collisions are not a concern here)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save into a temporary file next to `path`, then rename it into place."""
    write_atomic(path, lambda f: np.save(f, array))


def save_json_atomic(path: Path, obj: object) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def atomic_dir(final: Path) -> contextlib.AbstractContextManager[Path]:
    """An empty temporary directory that becomes `final` when the block succeeds. If another process
    published `final` first, its copy wins and ours is discarded: entries with the same name have the same
    content by construction."""
    return fsio.atomic_dir(final, replace=False)
