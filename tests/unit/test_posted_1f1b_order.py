"""The posted 1F1B's per-stage programs (dsx3d/pipeline/posted_1f1b.py): every pass once, 1F1B's order and
in-flight bound, buffers reused only after their backward, and the whole pipeline runs to the end with sends
that never wait and receives that do. No processes."""

from __future__ import annotations

import pytest

from dsx3d.pipeline.posted_1f1b import Posted1F1BSchedule, program

SHAPES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_each_stage_runs_every_pass_once_in_1f1b_order(p: int, m: int) -> None:
    for s in range(p):
        prog = program(p, m, s)
        passes = [op for op in prog if op[0] in ("F", "B")]
        assert sorted(passes) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        assert [j for k, j in passes if k == "F"] == list(range(m)) == [j for k, j in passes if k == "B"]
        in_flight, peak = 0, 0
        for kind, _ in passes:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(p - s, m)  # 1F1B's bound on stage s
        buffers = Posted1F1BSchedule(micro_batches=m, stages=p, stage_id=s).num_pipe_buffers()
        live: dict[int, int] = {}
        for kind, j in passes:  # a buffer takes a new micro-batch only after the last one's backward
            if kind == "F":
                assert j % buffers not in live, (s, j)
                live[j % buffers] = j
            else:
                assert live.pop(j % buffers) == j
        # a receive just before its pass, a send just after it, nothing to or from beyond the pipeline's ends
        for i, (kind, j) in enumerate(prog):
            if kind == "RecvAct":
                assert s > 0 and prog[i + 1] == ("F", j)
            if kind == "RecvGrad":
                assert s < p - 1 and prog[i + 1] == ("B", j)
            if kind == "SendAct":
                assert s < p - 1 and prog[i - 1] == ("F", j)
            if kind == "SendGrad":
                assert s > 0 and prog[i - 1] == ("B", j)


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_posted_sends_and_blocking_receives_run_to_the_end(p: int, m: int) -> None:
    """Stages advance one instruction at a time; a send never waits, a receive waits for its message (in
    order per direction). Every stage must finish (no deadlock) and receive exactly what was sent."""
    progs = [program(p, m, s) for s in range(p)]
    pc = [0] * p
    sent: dict[tuple[int, str], list[int]] = {}
    taken: dict[tuple[int, str], int] = {}
    while any(pc[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(progs[s]):
                kind, j = progs[s][pc[s]]
                if kind in ("RecvAct", "RecvGrad"):
                    key = (s, kind)
                    queue = sent.get(key, [])
                    if taken.get(key, 0) >= len(queue):
                        break  # waits for the neighbour
                    assert queue[taken.get(key, 0)] == j, "messages arrive in micro-batch order"
                    taken[key] = taken.get(key, 0) + 1
                elif kind == "SendAct":
                    sent.setdefault((s + 1, "RecvAct"), []).append(j)
                elif kind == "SendGrad":
                    sent.setdefault((s - 1, "RecvGrad"), []).append(j)
                pc[s] += 1
                moved = True
        assert moved, f"deadlock at {pc}"
    assert all(taken.get(k, 0) == len(v) for k, v in sent.items())
