"""The `--json` contract: exactly one JSON object on stdout, everything else on stderr.

Third-party code writes to stdout on its own (DeepSpeed's logger has a stdout handler; forked ranks inherit
file descriptor 1), so while a `--json` command runs, `json_mode` points both the file descriptor and
`sys.stdout` at stderr and keeps the real stdout for `emit`. Commands print their result with `emit`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import IO

_result_stream: IO[str] | None = None


def emit(obj: object) -> None:
    """Write `obj` as one JSON line on the command's stdout (the real one, also inside `json_mode`)."""
    stream = _result_stream if _result_stream is not None else sys.stdout
    stream.write(json.dumps(obj) + "\n")
    stream.flush()


@contextlib.contextmanager
def json_mode() -> Iterator[None]:
    """Route every other write to stdout onto stderr until the block ends; `emit` still reaches stdout."""
    global _result_stream
    out = sys.stdout
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests): no descriptor to move
        fd = -1
    out.flush()
    saved_fd = os.dup(fd) if fd >= 0 else -1
    if saved_fd >= 0:
        os.dup2(sys.stderr.fileno(), fd)
        result: IO[str] = os.fdopen(os.dup(saved_fd), "w", encoding="utf-8")
    else:
        result = out
    previous, _result_stream = _result_stream, result
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stdout = out
        _result_stream = previous
        if saved_fd >= 0:
            result.close()
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
