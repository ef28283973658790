"""Throughput arithmetic and OUTPUT_DIR/metrics.jsonl, one JSON object per logged step.

metrics.jsonl is append-only and flushed after every line, so `tail -f` follows a run and a crash loses at
most the line being written. A resumed run appends to it; steps between the last checkpoint and a crash
then appear twice, and readers keep the last entry of each step (`read_metrics` does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dsx3d.fsio import make_dirs, share_tree


@dataclass(frozen=True)
class Throughput:
    """Tokens and model FLOPs of one optimizer step: 6 * N * tokens (forward 2N, backward 4N)."""

    tokens_per_step: int
    """train.micro_batch_size x gradient_accumulation_steps x dp x seq_len."""
    flop_params: int
    """N: parameters a token multiplies through (decoder layers and head; the embedding lookup is free)."""
    world_size: int

    def tokens_per_s(self, steps: int, seconds: float) -> float:
        return steps * self.tokens_per_step / seconds if seconds > 0 else 0.0

    def tflops_per_device(self, steps: int, seconds: float) -> float:
        """Estimated model TFLOP/s per process: 6 * N * tokens / time / world."""
        return 6 * self.flop_params * self.tokens_per_s(steps, seconds) / self.world_size / 1e12


class MetricsLog:
    """Appends one JSON line per call and flushes it."""

    def __init__(self, path: Path):
        make_dirs(path.parent)
        self.path = path
        self._file: IO[str] = path.open("a")
        share_tree(path)

    def write(self, record: Mapping[str, object]) -> None:
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl by step, the last one of each step winning (a resume repeats steps)."""
    by_step: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]
