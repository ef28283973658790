"""Replay one measured pipeline step with each instruction's CPU time as its duration.

On an oversubscribed machine an instruction's wall time is mostly waiting for a core, and that wait differs
between schedules doing the same work (a rank that blocks often is rescheduled sooner). The replay keeps what
the schedule decides, the order of every stage's instructions and which receive waits for which send, and
replaces the durations by the CPU time each instruction took. A receive ends no earlier than the matching
send (the k-th SendActivation of stage s pairs with the k-th RecvActivation of stage s+1; SendGrad and
RecvGrad the other way); a blocking send (DeepSpeed's) also ends no earlier than its receive starts, a
posted one (zb-h1's PostActivation and PostGrad) does not wait. Transfers take no time.

    replay({stage: [(name, cpu_seconds), ...]}) -> {"window": s, "busy": {stage: s}, "finish": {stage: s}}
"""

from __future__ import annotations

from typing import Any

BUSY = ("ForwardPass", "BackwardPass", "BackwardInput", "BackwardWeight")
_PEER = {  # instruction -> (channel, role, stage offset of the peer)
    "SendActivation": ("act", "send", 1),
    "PostActivation": ("act", "post", 1),
    "RecvActivation": ("act", "recv", -1),
    "SendGrad": ("grad", "send", -1),
    "PostGrad": ("grad", "post", -1),
    "RecvGrad": ("grad", "recv", 1),
}


def replay(programs: dict[int, list[tuple[str, float]]]) -> dict[str, Any]:
    """Each stage's instructions in order, with durations; the replayed window (to the last busy end)."""
    clock = dict.fromkeys(programs, 0.0)
    pos = dict.fromkeys(programs, 0)
    sends: dict[tuple[str, int, int], list[float]] = {}  # (channel, from, to) -> post times
    recvs: dict[tuple[str, int, int], list[float]] = {}  # (channel, from, to) -> recv start times
    count: dict[tuple[str, int, str], int] = {}
    busy = dict.fromkeys(programs, 0.0)
    finish = dict.fromkeys(programs, 0.0)
    while any(pos[s] < len(programs[s]) for s in programs):
        moved = False
        for s, program in programs.items():
            while pos[s] < len(program):
                name, dur = program[pos[s]]
                start = clock[s]
                if name in _PEER:
                    channel, role, off = _PEER[name]
                    key = (channel, s, s + off) if role != "recv" else (channel, s + off, s)
                    k = count.get((channel, s, role), 0)
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
                    count[(channel, s, role)] = k + 1
                clock[s] = start + dur
                if name in BUSY:
                    busy[s] += dur
                    finish[s] = clock[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"replay deadlocked at {pos}")
    return {"window": max(finish.values()), "busy": busy, "finish": finish}
