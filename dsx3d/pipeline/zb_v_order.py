"""The order of ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024; the V-shaped
zero-bubble schedule of "Zero Bubble Pipeline Parallelism", ICLR 2024): each of the p ranks holds two chunks placed
in a V (rank r holds stages r and 2p - 1 - r of 2p, `dsx3d.pipeline.split.stage_of`), every backward split into B
(the input gradient) and W (the weight gradients), and W run where a rank would otherwise wait.

The order is built by a greedy list scheduler over a discrete-event simulation, given the F, B and W durations
of one chunk and a transfer's (the approach of `dsx3d.pipeline.zb_greedy`, on two chunks per rank):

- the rank whose clock is earliest decides next; a ready B comes first (oldest micro-batch, then the chunk
  nearer the loss): ranks downstream wait for it;
- then a ready F, while the rank holds fewer than `cap` chunk activations (F run, W not yet), keeping one place
  for the second chunk, whose F leads to the loss and frees memory: the first chunk's F needs two free places
  (without that reserve the first chunk could fill every place and wait forever for backwards that need the
  second); policies prefer the second chunk's F or the oldest micro-batch;
- otherwise a pending W when the rank would wait at least `patience` W-durations for its next input, else it
  idles until that input.

The default cap, 2p chunks of half a stage each, is 1F1B's peak on its first stage (p micro-batches of a whole
stage): ZB-V's memory claim. Several policies are simulated with every pass as early as its inputs allow and the
shortest step kept. `rank_program` gives each rank's passes with posted sends (each send right after the pass
that made its tensor, each receive right before the pass that needs it); that cannot deadlock, since every
receive waits for a send that follows a pass the simulation ran earlier. Between the two chunks of rank p - 1
(stages p - 1 and p) the message stays on the rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dsx3d.pipeline.split import rank_of, stage_of
from dsx3d.pipeline.zb_greedy import makespan

VOp = tuple[str, int, int]
"""("F" | "B" | "W", stage, micro-batch)."""


@dataclass(frozen=True)
class VCosts:
    """One chunk's F, B and W durations (equal chunks), and one transfer's."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0

    def of(self, kind: str) -> float:
        return {"F": self.f, "B": self.b, "W": self.w}[kind]


@dataclass(frozen=True)
class VTimed:
    op: VOp
    start: float
    end: float


VPlan = tuple[tuple[VTimed, ...], ...]
BUILD_DEFAULT = VCosts(1.0, 1.25, 0.6)
"""The costs the order is built for when none are given. An order is a fixed sequence per rank, and one built
for F = B = W stalls when B runs longer than F: on this project's CPU runs (F, B, W per chunk pass 23, 29,
13 ms) the equal-cost order idled 0.27 at p = 4, m = 8, the order built for the measured costs 0.09. Orders
built for B = 1.25 F, W = 0.6 F (near the measured ratios) stay within 0.05 of the best order for equal costs,
for B = 2 F, W = F, for B = W = 0.8 F and for the measured ratios (tests/unit/test_zb_v.py)."""
PREFERENCES = ("second-chunk", "oldest")
PATIENCES = (0.0, 0.5, 1.0, float("inf"))


def _dependency(kind: str, s: int, j: int, stages: int) -> tuple[str, int, int] | None:
    if kind == "F":
        return ("F", s - 1, j) if s > 0 else None
    if kind == "B":
        return ("B", s + 1, j) if s + 1 < stages else ("F", s, j)
    return ("B", s, j)


def _arrival(done: dict[tuple[str, int, int], float], dep: tuple[str, int, int] | None, rank: int, p: int, comm: float) -> float | None:
    """When `dep`'s result is usable on `rank` (None: not run yet)."""
    if dep is None:
        return 0.0
    end = done.get(dep)
    if end is None:
        return None
    return end + (comm if rank_of(dep[1], p, "v") != rank else 0.0)


def greedy(p: int, m: int, costs: VCosts, cap: int, preference: str, patience: float) -> list[list[VOp]]:
    """One policy's order per rank (raises RuntimeError where it gets stuck)."""
    stages = 2 * p
    done: dict[tuple[str, int, int], float] = {}
    nf, nb = [0] * stages, [0] * stages
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held, clock = [0] * p, [0.0] * p
    orders: list[list[VOp]] = [[] for _ in range(p)]
    finished = [False] * p
    while not all(finished):
        r = min((x for x in range(p) if not finished[x]), key=lambda x: (clock[x], x))
        t = clock[r]
        mine = (stage_of(r, 0, p, "v"), stage_of(r, 1, p, "v"))
        ready: list[tuple[tuple[float, ...], VOp]] = []
        future: list[float] = []
        for c, s in enumerate(mine):
            if nb[s] < nf[s]:
                at = _arrival(done, _dependency("B", s, nb[s], stages), r, p, costs.comm)
                if at is not None and at <= t:
                    ready.append(((0, nb[s], -c), ("B", s, nb[s])))
                elif at is not None:
                    future.append(at)
            room = cap - held[r] - (1 if c == 0 else 0)
            if nf[s] < m and room > 0:
                at = _arrival(done, _dependency("F", s, nf[s], stages), r, p, costs.comm)
                if at is not None and at <= t:
                    key = (1, -c, nf[s]) if preference == "second-chunk" else (1, nf[s], -c)
                    ready.append((key, ("F", s, nf[s])))
                elif at is not None:
                    future.append(at)
        op: VOp | None = min(ready)[1] if ready else None
        if op is None and pending_w[r]:
            soonest = min(future, default=None)
            if soonest is None or soonest - t >= patience * costs.w:
                s, j = pending_w[r].pop(0)
                op = ("W", s, j)
        if op is None:
            if all(nb[s] == m for s in mine) and not pending_w[r]:
                finished[r] = True
                continue
            others = [clock[x] for x in range(p) if x != r and not finished[x] and clock[x] > t]
            later = [x for x in future if x > t] + others
            if not later:
                if any(clock[x] == t for x in range(p) if x != r and not finished[x]):
                    clock[r] = t + 1e-9 * max(costs.f, costs.b, costs.w)  # let a rank at the same time decide first
                    continue
                raise RuntimeError(f"ZB-V order stuck: rank {r} at {t}, F {nf}, B {nb}, held {held}")
            clock[r] = min(later)
            continue
        kind, s, j = op
        end = t + costs.of(kind)
        done[op] = clock[r] = end
        orders[r].append(op)
        if kind == "F":
            nf[s] += 1
            held[r] += 1
        elif kind == "B":
            nb[s] += 1
            pending_w[r].append((s, j))
        else:
            held[r] -= 1
    return orders


def simulate(orders: list[list[VOp]], costs: VCosts) -> VPlan:
    """Each rank runs its passes in the given order, each as soon as its inputs have arrived."""
    p = len(orders)
    stages = 2 * p
    done: dict[tuple[str, int, int], float] = {}
    plan: list[list[VTimed]] = [[] for _ in range(p)]
    pos, clock = [0] * p, [0.0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, s, j = op = orders[r][pos[r]]
                at = _arrival(done, _dependency(kind, s, j, stages), r, p, costs.comm)
                if at is None:
                    break
                start = max(clock[r], at)
                done[op] = clock[r] = start + costs.of(kind)
                plan[r].append(VTimed(op, start, clock[r]))
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"ZB-V order deadlocks at {pos}")
    return tuple(tuple(row) for row in plan)


@functools.lru_cache(maxsize=256)
def best_plan(p: int, m: int, costs: VCosts = VCosts(), cap: int | None = None) -> VPlan:
    """The shortest step over the policies (ties: the earlier), within `cap` chunk activations per rank
    (default 2p: 1F1B's peak)."""
    if p < 2 or m < 1:
        raise ValueError(f"ZB-V needs pp >= 2 and at least one micro-batch, got pp {p}, m {m}")
    if min(costs.f, costs.b, costs.w) <= 0:
        raise ValueError("every F, B and W duration must be positive")
    limit = cap if cap is not None else 2 * p
    best: VPlan | None = None
    for preference in PREFERENCES:
        for patience in PATIENCES:
            try:
                plan = simulate(greedy(p, m, costs, limit, preference, patience), costs)
            except RuntimeError:
                continue
            if best is None or makespan(plan) < makespan(best) - 1e-9:
                best = plan
    if best is None:
        raise RuntimeError(f"no ZB-V order found for pp {p}, m {m} within {limit} chunk activations per rank")
    return best


@functools.lru_cache(maxsize=256)
def run_plan(p: int, m: int, build: VCosts = BUILD_DEFAULT, run: VCosts = VCosts()) -> VPlan:
    """The order built for `build`, timed with the durations `run`."""
    return simulate([[x.op for x in row] for row in best_plan(p, m, build)], run)


def rank_program(plan: VPlan, rank: int) -> list[VOp]:
    """Rank `rank`'s instructions: ("F" | "B" | "W" | "RecvAct" | "SendAct" | "RecvGrad" | "SendGrad", stage,
    micro-batch), the receive right before its pass and the send right after it (posted sends)."""
    stages = 2 * len(plan)
    out: list[VOp] = []
    for x in plan[rank]:
        kind, s, j = x.op
        if kind == "F" and s > 0:
            out.append(("RecvAct", s, j))
        elif kind == "B" and s + 1 < stages:
            out.append(("RecvGrad", s, j))
        out.append(x.op)
        if kind == "F" and s + 1 < stages:
            out.append(("SendAct", s, j))
        elif kind == "B" and s > 0:
            out.append(("SendGrad", s, j))
    return out
