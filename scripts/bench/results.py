"""Where benchmark results go: scripts/bench/results.json, one key per benchmark, merged under a lock and
written atomically, each with the command that produced it and the machine's load. No torch imports, so
light benchmarks (CLI start-up) use it too."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any

from dsx3d.fsio import write_atomic

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results.json"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def command() -> str:
    """The command line that reproduces this run: `python -m scripts.bench.NAME ARGS`."""
    module = os.path.relpath(sys.argv[0], REPO).removesuffix(".py").replace(os.sep, ".")
    return " ".join(["python -m", module, *sys.argv[1:]])


def merge_results(key: str, value: Any, path: Path = RESULTS) -> None:
    """Set `key` in the results JSON, keeping every other key (other benchmarks, other workers), under an
    exclusive lock on the folder, written atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data: dict[str, Any] = {}
        if path.exists():
            text = path.read_text()
            data = json.loads(text) if text.strip() else {}
        data[key] = value
        write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)


def emit(key: str, result: dict[str, Any], write: bool) -> None:
    """Print the result as one JSON object on stdout and merge it into scripts/bench/results.json."""
    if write:
        merge_results(key, result)
    print(json.dumps({key: result}, indent=2, sort_keys=True))


def rounded(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")
