"""The ZB-H1 zero-bubble order of work (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), as plain data.

Each backward is split in two: B, the gradient of the stage's input (the previous stage waits for it), and W,
the gradients of the weights (nobody waits for them). Stages run on common ticks of one unit of work each
(F, B and W cost about the same: each is one pass over the layers' matrix products). Every tick, a stage
runs the first of these that it can:

1. B of its oldest micro-batch whose output gradient has arrived (the last stage: whose forward just ran);
2. F of the next micro-batch whose input has arrived, if fewer than `p - stage` micro-batches are between
   their F and their W (1F1B keeps at most `p - stage` activations alive; so does this order: ZB-H1);
3. W of its oldest micro-batch past B;

and idles otherwise. A tensor made in tick k can be used from tick k + 1. With F = B = W the idle time of a
stage is about (p - 1) units out of 3m + p - 1, a third of 1F1B's 3(p - 1) out of 3(m + p - 1).

Transfers are blocking on gloo and NCCL alike (a send waits for its receive): each happens at the tick boundary
just before the receiver uses it, and at a boundary every stage runs its transfers ordered by (link, direction),
the same order on both ends of each link, so the transfers of all stages form one global sequence and the
order cannot deadlock, whatever the real durations (`transfers`).
"""

from __future__ import annotations

from dataclasses import dataclass

Op = tuple[str, int]
"""("F" | "B" | "W", micro-batch)."""


@dataclass(frozen=True)
class Transfer:
    """At the boundary before tick `tick`: activation ("act", stage -> stage + 1) or gradient ("grad", stage + 1
    -> stage) of `micro_batch` over link `link` (between stages link and link + 1)."""

    tick: int
    link: int
    kind: str
    micro_batch: int


def compute_ticks(stages: int, micro_batches: int) -> list[list[Op | None]]:
    """Per stage, what it runs in each tick (None: idle), until every stage has run every F, B and W."""
    p, m = stages, micro_batches
    act_ready = [[-1] * m for _ in range(p)]  # tick from which stage s may run F of j (its input is there)
    grad_ready = [[-1] * m for _ in range(p)]  # tick from which stage s may run B of j
    for j in range(m):
        act_ready[0][j] = 0
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    ticks: list[list[Op | None]] = [[] for _ in range(p)]
    tick = 0
    while any(nw[s] < m for s in range(p)):
        done: list[tuple[int, Op]] = []
        for s in range(p):
            op: Op | None = None
            if nb[s] < nf[s] and 0 <= grad_ready[s][nb[s]] <= tick:
                op = ("B", nb[s])
            elif nf[s] < m and 0 <= act_ready[s][nf[s]] <= tick and nf[s] - nb[s] < p - s and nf[s] - nw[s] < p:
                op = ("F", nf[s])
            elif nw[s] < nb[s]:
                op = ("W", nw[s])
            ticks[s].append(op)
            if op is not None:
                done.append((s, op))
        for s, (kind, j) in done:
            if kind == "F":
                nf[s] += 1
                if s + 1 < p:
                    act_ready[s + 1][j] = tick + 1
                else:
                    grad_ready[s][j] = tick + 1
            elif kind == "B":
                nb[s] += 1
                if s > 0:
                    grad_ready[s - 1][j] = tick + 1
            else:
                nw[s] += 1
        tick += 1
    return ticks


def transfers(ticks: list[list[Op | None]]) -> list[Transfer]:
    """Every activation and gradient transfer, at the boundary just before its receiver's tick, in the global
    order (tick, link, activations before gradients)."""
    out = []
    for s, row in enumerate(ticks):
        for t, op in enumerate(row):
            if op is None:
                continue
            kind, j = op
            if kind == "F" and s > 0:
                out.append(Transfer(t, s - 1, "act", j))
            elif kind == "B" and s + 1 < len(ticks):
                out.append(Transfer(t, s, "grad", j))
    return sorted(out, key=lambda x: (x.tick, x.link, x.kind != "act"))


def stage_program(ticks: list[list[Op | None]], stage: int) -> list[tuple[str, int]]:
    """This stage's sequence of ("SendAct" | "RecvAct" | "SendGrad" | "RecvGrad" | "F" | "B" | "W", micro-batch):
    its transfers at each boundary (in the global order) followed by its work in that tick."""
    by_tick: dict[int, list[tuple[str, int]]] = {}
    for x in transfers(ticks):
        if x.kind == "act" and x.link == stage:
            by_tick.setdefault(x.tick, []).append(("SendAct", x.micro_batch))
        elif x.kind == "act" and x.link == stage - 1:
            by_tick.setdefault(x.tick, []).append(("RecvAct", x.micro_batch))
        elif x.kind == "grad" and x.link == stage - 1:
            by_tick.setdefault(x.tick, []).append(("SendGrad", x.micro_batch))
        elif x.kind == "grad" and x.link == stage:
            by_tick.setdefault(x.tick, []).append(("RecvGrad", x.micro_batch))
    program: list[tuple[str, int]] = []
    for t, op in enumerate(ticks[stage]):
        program.extend(by_tick.get(t, []))
        if op is not None:
            program.append(op)
    return program


def idle_fraction(ticks: list[list[Op | None]]) -> list[float]:
    """Per stage, idle ticks / the span from the first tick to the last one any stage works in."""
    span = len(ticks[0])
    return [1 - sum(op is not None for op in row) / span for row in ticks]


def peak_in_flight(ticks: list[list[Op | None]], stage: int) -> int:
    """The most micro-batches this stage holds between their F and their W."""
    held = peak = 0
    for op in ticks[stage]:
        if op is not None and op[0] == "F":
            held += 1
            peak = max(peak, held)
        elif op is not None and op[0] == "W":
            held -= 1
    return peak


def analytic_idle(stages: int, micro_batches: int) -> float:
    """ZB-H1's mean idle fraction with F = B = W (exactly what `compute_ticks` yields for these costs)."""
    ticks = compute_ticks(stages, micro_batches)
    return sum(idle_fraction(ticks)) / stages
