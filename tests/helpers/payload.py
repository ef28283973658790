"""A checkpoint file that runs code when unpickled: it touches a marker file (for tests of safe loading)."""

from __future__ import annotations

from pathlib import Path

import torch


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def write_pickle_payload(path: Path, marker: Path) -> Path:
    """A torch zip file at `path` holding a tensor and an object whose unpickling creates `marker`."""
    torch.save({"weights": torch.zeros(2), "extra": _Payload(Path(marker))}, path)
    return path
