"""The zero-bubble ZB-H1 schedule (parallel.schedule: zb-h1): its order of work, the deferred weight gradients,
parity with single-process HF through `dsx3d verify` (pp 2 and 4, TP, tied embeddings, m > p), and that verify
catches a W pass skipped or run twice. DSX3D_ZB_SWEEP=1 adds a larger sweep of layouts and families."""

from __future__ import annotations

import os

import pytest
import torch

from dsx3d.distributed.tensor_parallel.weight_grad import WEIGHT_GRADS, linear
from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline import zb_plan
from dsx3d.verify.parity import ParityCase, run_verify
from dsx3d.verify.zb_faults import ZB_FAULTS

SHAPES = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 5, 8, 16)]


def _rendezvous_completes(programs: list[list[tuple[str, int]]]) -> bool:
    """Run the stage programs with blocking sends (a send waits for its receive, as gloo's does): True when
    every stage gets to its end."""
    pc = [0] * len(programs)
    pair = {"SendAct": ("RecvAct", 1), "RecvAct": ("SendAct", -1), "SendGrad": ("RecvGrad", -1), "RecvGrad": ("SendGrad", 1)}
    moved = True
    while moved:
        moved = False
        for s, prog in enumerate(programs):
            while pc[s] < len(prog):
                name, j = prog[pc[s]]
                if name in ("F", "B", "W"):
                    pc[s] += 1
                    moved = True
                    continue
                want, step = pair[name]
                peer = s + step
                if pc[peer] < len(programs[peer]) and programs[peer][pc[peer]] == (want, j):
                    pc[s] += 1
                    pc[peer] += 1
                    moved = True
                    continue
                break
    return all(pc[s] == len(p) for s, p in enumerate(programs))


@pytest.mark.parametrize("p,m", SHAPES, ids=[f"p{p}-m{m}" for p, m in SHAPES])
def test_plan_runs_every_pass_once_within_1f1b_memory_and_cannot_deadlock(p: int, m: int) -> None:
    ticks = zb_plan.compute_ticks(p, m)
    for s, row in enumerate(ticks):
        ops = [op for op in row if op is not None]
        assert sorted(ops) == sorted((k, j) for k in "FBW" for j in range(m))
        for k in "FBW":  # each kind in micro-batch order, and F before B before W
            assert [j for kind, j in ops if kind == k] == list(range(m))
        for j in range(m):
            assert ops.index(("F", j)) < ops.index(("B", j)) < ops.index(("W", j))
        assert zb_plan.peak_in_flight(ticks, s) <= min(p, m)  # 1F1B's first stage holds min(p, m)
    last = [op for op in ticks[-1] if op is not None]
    for j in range(m):  # DeepSpeed's last stage backpropagates the loss of its latest forward
        assert last.index(("B", j)) == last.index(("F", j)) + 1
    assert _rendezvous_completes([zb_plan.stage_program(ticks, s) for s in range(p)])


def test_plan_beats_1f1b_and_reaches_a_third_at_two_stages() -> None:
    for m in (4, 8, 16):
        assert zb_plan.analytic_idle(2, m) == pytest.approx(1 / (3 * m + 1))  # (p-1)/(3m+p-1)
        for p in (2, 4, 8):
            if m >= p:
                assert zb_plan.analytic_idle(p, m) < (p - 1) / (m + p - 1)


def test_a_deadlocking_order_is_detected() -> None:
    """The rendezvous check can fail: both ends of a link sending first."""
    assert not _rendezvous_completes([[("SendAct", 0), ("RecvGrad", 0)], [("SendGrad", 0), ("RecvAct", 0)]])


def test_deferred_weight_gradient_equals_the_immediate_one() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(6, 8))
    b = torch.nn.Parameter(torch.randn(6))
    ref_x = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(ref_x, w, b).square().sum().backward()
    ref_w, ref_b = w.grad.clone(), b.grad.clone()
    w.grad = b.grad = None
    with WEIGHT_GRADS.collect(7):
        linear(x, w, b).square().sum().backward()
    assert w.grad is None and b.grad is None  # B computed only the input gradient
    torch.testing.assert_close(x.grad, ref_x.grad)
    assert WEIGHT_GRADS.run(7) == 1
    torch.testing.assert_close(w.grad, ref_w)
    torch.testing.assert_close(b.grad, ref_b)
    assert not WEIGHT_GRADS.pending


def test_a_hooked_weight_is_not_deferred() -> None:
    w = torch.nn.Parameter(torch.randn(4, 4))
    w.register_hook(lambda g: g)
    with WEIGHT_GRADS.collect(0):
        linear(torch.randn(2, 4, requires_grad=True), w).sum().backward()
    assert w.grad is not None and WEIGHT_GRADS.run(0) == 0


def _ok(case: ParityCase) -> bool:
    return all(r.ok for r in run_verify(case))


CI_CASES = [
    # (family, dp, tp, pp, m): tp 1 and 2, pp 2 and 4, tied embeddings, m > p
    ("llama", 1, 1, 2, 4),
    ("qwen3", 1, 2, 2, 3),  # tied, q/k norms, sequence parallelism
    ("qwen3", 1, 1, 4, 6),
]
SWEEP_CASES = [
    (fam, dp, tp, pp, m)
    for fam in ("llama", "qwen2", "gemma2", "qwen3")
    for dp, tp, pp in ((1, 1, 2), (1, 2, 2), (2, 1, 2), (1, 1, 4), (1, 2, 4))
    for m in (pp, 2 * pp + 1)
]
CASES = SWEEP_CASES if os.environ.get("DSX3D_ZB_SWEEP") else CI_CASES


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_zb_h1_parity(case: tuple[str, int, int, int, int]) -> None:
    fam, dp, tp, pp, m = case
    config = tiny_config(fam, tie_word_embeddings=True) if fam == "qwen3" else tiny_config(fam)
    assert _ok(ParityCase(config, dp=dp, tp=tp, pp=pp, micro_batches=m, steps=2, schedule="zb-h1"))


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize("fault", sorted(ZB_FAULTS))
def test_verify_catches_a_broken_weight_pass(fault: str) -> None:
    with ZB_FAULTS[fault]():
        assert not _ok(ParityCase(tiny_config("llama"), dp=1, tp=2, pp=2, micro_batches=3, steps=2, schedule="zb-h1"))
