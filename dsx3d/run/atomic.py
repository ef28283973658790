"""Writing a file so that readers see the old content or the new one, never a mix, even if the writer dies.

Light on imports: the CLI writes configs and recipes with it before any heavy library is loaded.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write to a temporary file in the same directory, fsync, rename over `path`. On any failure (a full
    disk included) the temporary file is removed and `path` keeps its old content."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
