"""A light timer around the instructions a DeepSpeed PipelineEngine executes (off unless installed).

`StageClock(engine)` gives one engine an instance copy of its instruction table whose entries record, per
instruction: its name, the micro-batch it works on (the k-th instruction of a kind works on micro-batch k:
DeepSpeed's 1F1B and zb-h1 both run each kind in micro-batch order), its wall start and end
(`time.perf_counter`, comparable across the processes of one machine) and its busy time. Busy time is the
calling thread's CPU time on a CPU run with one intra-op thread (there, wall time also counts the wait for a
core on an oversubscribed machine), else wall time with the accelerator synchronised at the end of F, B and W
(their kernels are asynchronous). Nothing is recorded on an engine without a clock.

`part_costs` reduces one stage's events to the median busy time of its F, B and W passes (zb-h1's costs;
under 1F1B, B is the fused backward and W is absent); `breakdown` splits a step into the passes, the waits in
receives and sends, loading micro-batches, everything else the engine runs as instructions, and the dispatch
gaps between instructions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsx3d.boundary_types import PipeEngine

PARTS = {
    "F": ("ForwardPass", "ChunkForward"),
    "B": ("BackwardPass", "BackwardInput", "ChunkBackward", "ChunkBackwardInput"),
    "W": ("BackwardWeight", "ChunkBackwardWeight"),
}
RECV = ("RecvActivation", "RecvGrad", "ChunkRecvAct", "ChunkRecvGrad")
SEND = ("SendActivation", "SendGrad", "PostActivation", "PostGrad", "ChunkSendAct", "ChunkSendGrad")
LOAD = ("LoadMicroBatch", "ChunkLoad")
_PASS_NAMES = frozenset(n for names in PARTS.values() for n in names)


@dataclass(frozen=True)
class Event:
    name: str
    micro_batch: int
    start: float
    end: float
    busy: float
    chunk: int | None = None
    """The model chunk the instruction ran (interleaved schedules' `Chunk*` instructions), else None."""

    @property
    def wall(self) -> float:
        return self.end - self.start


def _synchronize() -> Callable[[], None] | None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else accelerator.synchronize


class StageClock:
    """Times every instruction of one engine; `take()` returns (and forgets) what was recorded since."""

    def __init__(self, engine: PipeEngine) -> None:
        self.events: list[Event] = []
        self._seen: dict[str, int] = {}
        sync = _synchronize()
        self.cpu_time = sync is None and torch.get_num_threads() == 1
        engine._INSTRUCTION_MAP = {kind: self._timed(kind.__name__, fn, sync) for kind, fn in engine._INSTRUCTION_MAP.items()}

    def _timed(self, name: str, fn: Callable[..., None], sync: Callable[[], None] | None) -> Callable[..., None]:
        is_pass = name in _PASS_NAMES

        def run(engine: object, *args: object, **kwargs: object) -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            fn(engine, *args, **kwargs)
            if is_pass and sync is not None:
                sync()
            t1 = time.perf_counter()
            k = self._seen.get(name, 0)
            self._seen[name] = k + 1
            busy = time.thread_time() - c0 if self.cpu_time else t1 - t0
            self.events.append(Event(name, k, t0, t1, busy, kwargs.get("chunk")))  # type: ignore[arg-type]

        return run

    def take(self) -> list[Event]:
        """The events since the last take: one training step when called between steps."""
        events, self.events, self._seen = self.events, [], {}
        return events


def part_costs(events: list[Event]) -> dict[str, float | None]:
    """Median busy seconds of one micro-batch's F, B and W on this stage (None: the part never ran)."""
    out: dict[str, float | None] = {}
    for part, names in PARTS.items():
        times = [e.busy for e in events if e.name in names]
        out[part] = statistics.median(times) if times else None
    return out


def category(name: str) -> str:
    """What an instruction is: `F`, `B` or `W` (a pass), `recv`, `send`, `load` or `other`."""
    part = next((p for p, names in PARTS.items() if name in names), None)
    return part or ("recv" if name in RECV else "send" if name in SEND else "load" if name in LOAD else "other")


def breakdown(events: list[Event]) -> dict[str, float]:
    """Wall seconds of one step on this stage, from its first instruction's start to its last one's end:
    `F`, `B`, `W` (the passes), `recv` and `send` (point-to-point, mostly waiting for the peer), `load`, `other`
    (the remaining instructions: tied and data-parallel gradient reduces, optimizer step) and `dispatch`
    (between instructions: the engine's loop and the schedule generator)."""
    if not events:
        return {}
    out = dict.fromkeys(("F", "B", "W", "recv", "send", "load", "other"), 0.0)
    for e in events:
        out[category(e.name)] += e.wall
    window = max(e.end for e in events) - min(e.start for e in events)
    out["dispatch"] = max(0.0, window - sum(out.values()))
    out["window"] = window
    return out
