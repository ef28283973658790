"""Interleaved 1F1B's order computes plain HF's gradients: a tiny Llama cut into v p looped stages (chunk c of rank r
is stage c p + r), every rank's program (`dsx3d.pipeline.interleaved.rank_program`) run in one process as the
ranks would run it, activations and gradients passed only through (kind, stage, micro-batch) messages, the
wrap-around link from rank p - 1's chunk c to rank 0's chunk c + 1 included. Against one HF forward and backward
over the same micro-batches: the loss and every parameter's gradient. A micro-batch swap on the wrap-around link
is caught. (No DeepSpeed: the order and the chunk routing, not the engine runtime, which is not built.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dsx3d.pipeline.interleaved import VIRTUAL_STAGES, rank_program
from tests.helpers.interleaved import model as _model
from tests.helpers.interleaved import reference as _reference
from tests.helpers.interleaved import stage_forward as _stage_forward

Route = Callable[[int, int], int]
"""(receiving stage, micro-batch) -> the micro-batch whose activation it is handed."""


def run_interleaved(model: torch.nn.Module, micro: list[torch.Tensor], pp: int, route: Route | None = None) -> float:
    """Every rank's program, round robin, each pass when its message has arrived; returns the mean loss and
    leaves the summed gradients of loss / m in `.grad`."""
    m, v = len(micro), VIRTUAL_STAGES
    stages, route = v * pp, route or (lambda s, j: j)
    programs = [rank_program(r, pp, m, v) for r in range(pp)]
    messages: dict[tuple[str, int, int], torch.Tensor] = {}
    held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    pos, losses = [0] * pp, []
    while any(pos[r] < len(programs[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if pos[r] == len(programs[r]):
                continue
            op = programs[r][pos[r]]
            s, j = op.chunk * pp + r, op.micro_batch
            if op.kind == "F":
                key = ("act", s, route(s, j))
                if s > 0 and key not in messages:
                    continue
                x = micro[j] if s == 0 else messages.pop(key).detach().requires_grad_()
                y = _stage_forward(model, s, stages, x, micro[j])
                held[(s, j)] = (x, y)
                if s < stages - 1:
                    messages[("act", s + 1, j)] = y.detach()
                else:
                    losses.append(float(y.detach()))
            else:
                if s < stages - 1 and ("grad", s, j) not in messages:
                    continue
                x, y = held.pop((s, j))
                if s == stages - 1:
                    (y / m).backward()
                else:
                    y.backward(messages.pop(("grad", s, j)))
                if s > 0:
                    messages[("grad", s - 1, j)] = x.grad
            pos[r] += 1
            moved = True
        assert moved, "deadlock"
    assert not held and not messages
    return sum(losses) / m


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _run(pp: int, m: int, route: Route | None = None) -> tuple[float, float, dict[str, float]]:
    model = _model()
    torch.manual_seed(1)
    micro = [torch.randint(0, model.config.vocab_size, (2, 16)) for _ in range(m)]
    ref_loss = _reference(model, micro)
    ref = _grads(model)
    loss = run_interleaved(model, micro, pp, route)
    got = _grads(model)
    assert set(got) == set(ref)
    errors = {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-12)) for n in ref}
    return ref_loss, loss, errors


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (2, 2)])
def test_interleaved_order_gives_hfs_loss_and_gradients(pp: int, m: int) -> None:
    ref_loss, loss, errors = _run(pp, m)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert max(errors.values()) < 1e-5, max(errors.items(), key=lambda kv: kv[1])


def test_a_micro_batch_swap_on_the_wrap_around_link_is_caught() -> None:
    """Rank 0's chunk 1 (stage p) handed micro-batches 0 and 1 the other way round."""
    pp = 2

    def swap(s: int, j: int) -> int:
        return {0: 1, 1: 0}.get(j, j) if s == pp else j

    ref_loss, loss, errors = _run(pp, 4, swap)
    assert max(errors.values()) > 1e-3 or abs(loss - ref_loss) > 1e-4
