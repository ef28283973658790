"""Each rank's peak memory over a logging interval, gathered to rank 0 for metrics.jsonl and the log line.

What is measured, by where the rank computes:
- a GPU: the device allocator's high-water mark (`torch.cuda.max_memory_allocated`), reset after each reading,
  so each record holds the peak of its own interval (kind "device_allocated");
- a CPU: the process's peak resident set size. Linux keeps it as VmHWM in /proc/self/status and resets it
  to the current RSS when "5" is written to /proc/self/clear_refs: read then reset, each record holds the
  interval's peak (kind "rss_interval"). Where that file cannot be written (an old kernel, a sandbox) only
  the process's peak since it started exists (`getrusage` ru_maxrss, which never decreases): records then
  hold that (kind "rss_process"), honest but not per interval.

The gather is one `gather` of one float per rank to rank 0, at logging steps only (every rank knows which:
`Reporter.due`), never at the other steps.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from dsx3d.distributed import comm

GB = 1024**3
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm_bytes() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with _CLEAR_REFS.open("w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """This rank's peak since the previous `read` (or since `start`)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.kind = "device_allocated" if self.on_gpu else ("rss_interval" if _reset_hwm() and _vm_hwm_bytes() else "rss_process")

    def start(self) -> None:
        """Forget what came before (model building, the first collective set-up)."""
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss_interval":
            _reset_hwm()

    def read(self) -> int:
        """Bytes: the peak since the previous read, then reset (the process's peak for "rss_process")."""
        if self.on_gpu:
            peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        if self.kind == "rss_interval":
            peak = _vm_hwm_bytes() or 0
            _reset_hwm()
            return peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


@dataclass(frozen=True)
class MemoryRecord:
    """The metrics.jsonl fields of one interval (rank 0 only)."""

    by_rank: list[float]
    """GB, by global rank."""
    stage_of_rank: list[int]
    kind: str

    @property
    def peak_gb(self) -> float:
        return max(self.by_rank)

    def fields(self) -> dict[str, object]:
        stages = max(self.stage_of_rank) + 1
        by_stage = [max(gb for gb, s in zip(self.by_rank, self.stage_of_rank, strict=True) if s == p) for p in range(stages)]
        peak = self.peak_gb
        return {
            "peak_mem_gb": peak,
            "peak_mem_rank": self.by_rank.index(peak),
            "peak_mem_gb_by_stage": by_stage,
            "peak_mem_gb_by_rank": self.by_rank,
            "peak_mem_kind": self.kind,
        }


def gather_peaks(meter: PeakMemory, stage_of_rank: list[int]) -> MemoryRecord | None:
    """Every rank's interval peak on rank 0 (None elsewhere); call on every rank at the same steps."""
    mine = torch.tensor([meter.read() / GB], dtype=torch.float64, device=meter.device)
    parts = comm.gather_to(mine, dst=0)
    if parts is None:
        return None
    return MemoryRecord([float(p.item()) for p in parts], stage_of_rank, meter.kind)
