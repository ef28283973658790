"""Replay one measured pipeline step with each instruction's CPU time as its duration.

On an oversubscribed machine an instruction's wall time is mostly waiting for a core, and that wait differs
between schedules doing the same work (a rank that blocks often is rescheduled sooner). The replay keeps what
the schedule decides, the order of every stage's instructions and which receive waits for which send, and
replaces the durations by the CPU time each instruction took. A receive ends no earlier than the matching
send (the k-th SendActivation of stage s pairs with the k-th RecvActivation of stage s+1; SendGrad and
RecvGrad the other way); a blocking send (DeepSpeed's) also ends no earlier than its receive starts, a
posted one (zb-h1's PostActivation and PostGrad, interleaved 1F1B's chunk sends) does not wait. Transfers take
no time. An instruction of an interleaved schedule carries its chunk c: on rank r it belongs to virtual stage
c p + r (V-shaped, zb-v: r or 2p - 1 - r), and its messages pair by virtual stage (the k-th send of virtual stage s to s + 1 with the k-th
receive of s + 1 from s, whichever ranks hold them).

    replay({stage: [(name, cpu_seconds[, chunk]), ...]}) -> {"window": s, "busy": {stage: s}, "finish": {stage: s}}
"""

from __future__ import annotations

from typing import Any

from dsx3d.pipeline.split import stage_of

BUSY = (
    "ForwardPass", "BackwardPass", "BackwardInput", "BackwardWeight",
    "ChunkForward", "ChunkBackward", "ChunkBackwardInput", "ChunkBackwardWeight",
)
_PEER = {  # instruction -> (channel, role, stage offset of the peer)
    "SendActivation": ("act", "send", 1),
    "PostActivation": ("act", "post", 1),
    "RecvActivation": ("act", "recv", -1),
    "SendGrad": ("grad", "send", -1),
    "PostGrad": ("grad", "post", -1),
    "RecvGrad": ("grad", "recv", 1),
    "ChunkSendAct": ("act", "post", 1),
    "ChunkRecvAct": ("act", "recv", -1),
    "ChunkSendGrad": ("grad", "post", -1),
    "ChunkRecvGrad": ("grad", "recv", 1),
}


def replay(programs: dict[int, list[tuple[Any, ...]]], shape: str = "looped") -> dict[str, Any]:
    """Each stage's instructions in order, with durations (and chunks, placed `shape`:
    `dsx3d.pipeline.split.stage_of`); the replayed window (to the last busy end)."""
    p = len(programs)
    clock = dict.fromkeys(programs, 0.0)
    pos = dict.fromkeys(programs, 0)
    sends: dict[tuple[str, int, int], list[float]] = {}  # (channel, from, to) -> post times
    recvs: dict[tuple[str, int, int], list[float]] = {}  # (channel, from, to) -> recv start times
    count: dict[tuple[tuple[str, int, int], str], int] = {}
    busy = dict.fromkeys(programs, 0.0)
    finish = dict.fromkeys(programs, 0.0)
    while any(pos[s] < len(programs[s]) for s in programs):
        moved = False
        for s, program in programs.items():
            while pos[s] < len(program):
                name, dur, *chunk = program[pos[s]]
                start = clock[s]
                if name in _PEER:
                    channel, role, off = _PEER[name]
                    vs = stage_of(s, chunk[0] or 0, p, shape) if chunk else s  # the virtual stage
                    key = (channel, vs, vs + off) if role != "recv" else (channel, vs + off, vs)
                    k = count.get((key, role), 0)
                    if role == "recv":
                        posted = sends.get(key, [])
                        if len(posted) <= k:
                            break  # the send is not posted yet: run another stage
                        recvs.setdefault(key, []).append(start)
                        start = max(start, posted[k])
                    else:
                        if len(sends.setdefault(key, [])) == k:  # not posted on an earlier visit
                            sends[key].append(start)
                        if role == "send":  # blocking: ends once the receive is posted
                            got = recvs.get(key, [])
                            if len(got) <= k:
                                break
                            start = max(start, got[k])
                    count[(key, role)] = k + 1
                clock[s] = start + dur
                if name in BUSY:
                    busy[s] += dur
                    finish[s] = clock[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"replay deadlocked at {pos}")
    return {"window": max(finish.values()), "busy": busy, "finish": finish}
