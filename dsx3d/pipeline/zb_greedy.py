"""A cost-aware zero-bubble order: ZB-H1's memory bound, with F, B and W passes of any duration.

`compute_ticks` (`dsx3d.pipeline.zb_plan`) assumes F = B = W. When B is longer than F and W shorter (as measured),
that order leaves stages waiting. Here the order is built by a greedy list scheduler over a discrete-event
simulation of the pipeline, given each stage's F, B and W durations and the time a transfer takes:

- the stage whose clock is earliest decides next; B of its oldest micro-batch whose output gradient has
  arrived comes first (the previous stage waits for it; the last stage runs B right after each F);
- then F of the next micro-batch whose input has arrived, while fewer than `cap` micro-batches are between
  their F and their W (the policy's cap: ZB-H1's p, or 1F1B's p - stage between F and B as well);
- otherwise a pending W when the stage would wait at least `patience` W-durations for its next receive,
  else it idles until that receive.

Several policies (cap kind x patience) give orders; each is simulated with passes as early as possible and the
shortest step is kept (ties: the earlier policy;
the first reproduces `compute_ticks` when every pass costs the same). Every policy keeps at most min(p, m)
micro-batches between F and W on any stage, the most that 1F1B's first stage holds.

Transfers: with blocking sends, each happens just before its receiver's pass starts and every stage runs its
transfers in one global order (simulated time, link, activations first), so the programs cannot deadlock
(`stage_program`). zb-h1 posts its sends, and runs `posted_program`: each send right after the pass that made
its tensor, each receive right before the pass that needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Op = tuple[str, int]
"""("F" | "B" | "W", micro-batch)."""


@dataclass(frozen=True)
class Costs:
    """Per stage, the duration of one micro-batch's F, B and W; `comm`: one transfer's duration."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float = 0.0

    @classmethod
    def uniform(cls, stages: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0) -> Costs:
        return cls((f,) * stages, (b,) * stages, (w,) * stages, comm)

    def of(self, kind: str, stage: int) -> float:
        return {"F": self.f, "B": self.b, "W": self.w}[kind][stage]


@dataclass(frozen=True)
class Timed:
    op: Op
    start: float
    end: float


Plan = list[list[Timed]]


class TimedPass(Protocol):
    """A timed pass of any order (`Timed`; ZB-V's `zb_v_order.VTimed`): its op, whose kind comes first."""

    @property
    def op(self) -> tuple[Any, ...]: ...

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


Rows = Sequence[Sequence[TimedPass]]
"""Per stage (or rank), its timed passes in order."""
POLICIES: tuple[tuple[str, float], ...] = tuple(
    (cap, patience) for cap in ("per-stage", "h1") for patience in (0.0, 0.25, 0.5, 1.0, float("inf"))
)


def _cap_ok(cap: str, s: int, p: int, nf: int, nb: int, nw: int) -> bool:
    if cap == "per-stage" and nf - nb >= p - s:
        return False
    return nf - nw < p


def greedy(stages: int, micro_batches: int, costs: Costs, cap: str = "per-stage", patience: float = 0.0) -> Plan:
    """One policy's order and simulated times."""
    p, m = stages, micro_batches
    if min(min(costs.f), min(costs.b), min(costs.w)) <= 0:
        raise ValueError("every F, B and W duration must be positive")
    act: list[list[float | None]] = [[0.0 if s == 0 else None for _ in range(m)] for s in range(p)]
    grad: list[list[float | None]] = [[None] * m for _ in range(p)]
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    clock = [0.0] * p
    plan: Plan = [[] for _ in range(p)]
    blocked: set[int] = set()
    while True:
        live = [s for s in range(p) if nw[s] < m and s not in blocked]
        if not live:
            if any(nw[s] < m for s in range(p)):
                raise RuntimeError(f"greedy order stuck at F {nf}, B {nb}, W {nw}")
            return plan
        s = min(live, key=lambda x: (clock[x], x))
        t = clock[s]
        # the next B's and F's inputs: (arrival, or None while unknown; the earliest it can arrive, producer)
        want: list[tuple[float | None, float, int]] = []
        if nb[s] < nf[s]:
            want.append((grad[s][nb[s]], clock[s + 1 if s + 1 < p else s] + costs.b[min(s + 1, p - 1)] + costs.comm, s + 1))
        if nf[s] < m and _cap_ok(cap, s, p, nf[s], nb[s], nw[s]):
            want.append((act[s][nf[s]], clock[max(s - 1, 0)] + costs.f[max(s - 1, 0)] + costs.comm, s - 1))
        op: Op | None = None
        if nb[s] < nf[s] and (g := grad[s][nb[s]]) is not None and g <= t:
            op = ("B", nb[s])
        elif want and want[-1][2] == s - 1 and (a := act[s][nf[s]]) is not None and a <= t:
            op = ("F", nf[s])
        elif nw[s] < nb[s]:
            soonest = min((a if a is not None else max(lb, t) for a, lb, _ in want), default=None)
            if soonest is None or soonest - t >= patience * costs.w[s]:
                op = ("W", nw[s])
        if op is None:
            known = [a for a, _, _ in want if a is not None and a > t]
            unknown = [lb for a, lb, _ in want if a is None]
            if any(c <= t for c in unknown) or not (known or unknown):
                blocked.add(s)  # a neighbour behind this stage still has to decide what reaches it
                continue
            clock[s] = min(known + unknown)
            blocked.clear()
            continue
        kind, j = op
        end = t + costs.of(kind, s)
        plan[s].append(Timed(op, t, end))
        clock[s] = end
        blocked.clear()
        if kind == "F":
            nf[s] += 1
            if s + 1 < p:
                act[s + 1][j] = end + costs.comm
            else:
                grad[s][j] = end
        elif kind == "B":
            nb[s] += 1
            if s > 0:
                grad[s - 1][j] = end + costs.comm
        else:
            nw[s] += 1


def makespan(plan: Rows) -> float:
    return max(x.end for row in plan for x in row)


def idle_fraction(plan: Plan) -> list[float]:
    """Per stage, 1 - busy time / the step (from 0 to the last pass of any stage)."""
    span = makespan(plan)
    return [1 - sum(x.end - x.start for x in row) / span for row in plan]


def peak_in_flight(plan: Rows, stage: int) -> int:
    """The most micro-batches (ZB-V: chunk activations) `stage` holds at once: F run, W not yet."""
    held = peak = 0
    for x in plan[stage]:
        held += {"F": 1, "W": -1}.get(x.op[0], 0)
        peak = max(peak, held)
    return peak


@functools.lru_cache(maxsize=256)
def best_plan(stages: int, micro_batches: int, costs: Costs) -> tuple[tuple[Timed, ...], ...]:
    """The shortest step over `POLICIES` (ties: the earlier policy), each order simulated with every pass as
    early as its inputs allow (what the engine does; never later than the greedy's own times)."""
    best: Plan | None = None
    for cap, patience in POLICIES:
        plan = simulate([[x.op for x in row] for row in greedy(stages, micro_batches, costs, cap, patience)], costs)
        if best is None or makespan(plan) < makespan(best) - 1e-9:
            best = plan
    assert best is not None
    return tuple(tuple(row) for row in best)


def simulate(orders: list[list[Op]], costs: Costs) -> Plan:
    """Each stage runs its passes in the given order, each as soon as its inputs have arrived (F of stage s
    after F of s - 1, B after B of s + 1, plus `costs.comm`; the last stage's B after its own F)."""
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    plan: Plan = [[] for _ in range(p)]
    pos, clock = [0] * p, [0.0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, j = orders[s][pos[s]]
                dep = {"F": ("F", s - 1, j) if s > 0 else None, "B": ("B", s + 1, j) if s + 1 < p else ("F", s, j)}
                need = dep.get(kind) or (("B", s, j) if kind == "W" else None)
                ready = 0.0
                if need is not None:
                    if need not in done:
                        break
                    ready = done[need] + (costs.comm if need[1] != s else 0.0)
                start = max(clock[s], ready)
                end = start + costs.of(kind, s)
                plan[s].append(Timed((kind, j), start, end))
                done[(kind, s, j)] = clock[s] = end
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"order deadlocks at {pos}")
    return plan


def one_f_one_b(stages: int, micro_batches: int) -> list[list[Op]]:
    """1F1B's order, its fused backward written as B then W."""
    orders = []
    for s in range(stages):
        warm = min(stages - s - 1, micro_batches)
        row: list[Op] = [("F", j) for j in range(warm)]
        for j in range(micro_batches):
            if warm + j < micro_batches:
                row.append(("F", warm + j))
            row += [("B", j), ("W", j)]
        orders.append(row)
    return orders


def stage_program(plan: Plan | tuple[tuple[Timed, ...], ...], stage: int) -> list[tuple[str, int]]:
    """This stage's ("SendAct" | "RecvAct" | "SendGrad" | "RecvGrad" | "F" | "B" | "W", micro-batch) sequence:
    each transfer at its receiver's start time, ahead of any pass starting then, all in one global order."""
    p = len(plan)
    items: list[tuple[float, int, int, int, tuple[str, int]]] = []
    for s, row in enumerate(plan):
        for x in row:
            kind, j = x.op
            if kind == "F" and s > 0 and stage in (s - 1, s):
                items.append((x.start, 0, s - 1, 0, ("SendAct" if stage == s - 1 else "RecvAct", j)))
            elif kind == "B" and s + 1 < p and stage in (s, s + 1):
                items.append((x.start, 0, s, 1, ("SendGrad" if stage == s + 1 else "RecvGrad", j)))
            if s == stage:
                items.append((x.start, 1, 0, 0, x.op))
    return [name for *_, name in sorted(items)]


def posted_program(plan: Plan | tuple[tuple[Timed, ...], ...], stage: int) -> list[tuple[str, int]]:
    """This stage's program for posted sends (a send does not wait for its receive): each pass in the plan's
    order, its receive just before it and its send just after it. A stage then waits only for what a pass
    needs, and a finished output leaves at once, whatever the real durations; `stage_program` instead places a
    send at its receiver's planned start, which holds it back behind the sender's later passes when the real
    durations differ from the planned ones. Cannot deadlock: a receive waits only for a send that follows its
    producing pass, and the passes' dependencies are acyclic (`simulate` orders them)."""
    p = len(plan)
    out: list[tuple[str, int]] = []
    for x in plan[stage]:
        kind, j = x.op
        if kind == "F" and stage > 0:
            out.append(("RecvAct", j))
        elif kind == "B" and stage + 1 < p:
            out.append(("RecvGrad", j))
        out.append(x.op)
        if kind == "F" and stage + 1 < p:
            out.append(("SendAct", j))
        elif kind == "B" and stage > 0:
            out.append(("SendGrad", j))
    return out
