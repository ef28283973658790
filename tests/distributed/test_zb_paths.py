"""Zero bubble's moving parts outside a full pipeline run: 1F1B keeps the native linear backward, a B pass
copies only the output gradients that live in the reused receive buffer, posted sends do not wait for the
receiver, and the CPU-time replay of the bubble benchmark."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch import nn

from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.layers import RowParallelLinear
from dsx3d.distributed.tensor_parallel.weight_grad import WeightGradQueue, defer_linears
from dsx3d.verify.harness import run_ranks
from scripts.bench.replay import replay


def _grad_fn_name(module: nn.Module) -> str:
    y = module(torch.randn(2, 3, 8, requires_grad=True))
    node = y.grad_fn
    while node is not None and "Linear" not in type(node).__name__ and node.next_functions:
        node = node.next_functions[0][0]
    return "" if node is None else type(node).__name__


def test_row_parallel_linear_keeps_the_native_backward_until_a_zero_bubble_engine_switches_it() -> None:
    row = RowParallelLinear(nn.Linear(8, 4, bias=False), TPContext())
    nn.init.normal_(row.weight)
    assert "Deferrable" not in _grad_fn_name(row)
    assert defer_linears(row) == 1
    assert "Deferrable" in _grad_fn_name(row)


def test_own_grads_copies_only_the_output_gradients_in_the_shared_buffer() -> None:
    queue = WeightGradQueue()
    w = nn.Parameter(torch.zeros(4, 8))
    received, other = torch.randn(6, 4), torch.randn(6, 4)
    with queue.collect(0):
        assert queue.defer(w, None, received.view(6, 4), torch.randn(6, 8))
        assert queue.defer(w, None, other, torch.randn(6, 8))
    assert queue.own_grads(0, {received.untyped_storage().data_ptr()}) == 1
    kept = queue.pending[0]
    assert kept[0].grad.untyped_storage().data_ptr() != received.untyped_storage().data_ptr()
    assert kept[1].grad is other
    expected = received.t() @ kept[0].inp + other.t() @ kept[1].inp
    received.zero_()  # the engine receives the next micro-batch's gradient into it
    assert queue.run(0) == 2
    torch.testing.assert_close(w.grad, expected)


def _posted_send(rank: int) -> float:
    import torch.distributed as dist

    from dsx3d.distributed.pending_sends import PendingSends

    t = torch.arange(4.0)
    if rank == 0:
        sends = PendingSends()
        p2p = SimpleNamespace(send=None, _grid=SimpleNamespace(stage_to_global=lambda stage_id: stage_id))
        t0 = time.perf_counter()
        with sends.posting(p2p):
            p2p.send(t, 1)
        elapsed = time.perf_counter() - t0
        assert p2p.send is None  # restored
        assert sends.wait() == 1
        return elapsed
    time.sleep(2.0)
    got = torch.zeros(4)
    dist.recv(got, 0)
    assert torch.equal(got, t)
    return 0.0


def test_a_posted_send_returns_before_the_receiver_receives() -> None:
    elapsed, _ = run_ranks(_posted_send, 2, timeout_s=120)
    assert elapsed < 1.0  # a blocking gloo send would wait the receiver's 2 s


def _one_f_one_b(m: int, f: float, b: float) -> dict[int, list[tuple[str, float]]]:
    """DeepSpeed's 1F1B at p = 2 (stage 0 receives each gradient before sending the next activation)."""
    first = [("ForwardPass", f), ("SendActivation", 0.0)]
    for j in range(m):
        if j + 1 < m:
            first += [("ForwardPass", f), ("RecvGrad", 0.0), ("SendActivation", 0.0), ("BackwardPass", b)]
        else:
            first += [("RecvGrad", 0.0), ("BackwardPass", b)]
    last = []
    for _ in range(m):
        last += [("RecvActivation", 0.0), ("ForwardPass", f), ("BackwardPass", b), ("SendGrad", 0.0)]
    return {0: first, 1: last}


def test_replay_of_1f1b_gives_the_textbook_window_and_posted_sends_do_not_wait() -> None:
    m, f, b = 4, 1.0, 2.0
    out = replay(_one_f_one_b(m, f, b))
    assert out["window"] == (m + 1) * (f + b)
    assert out["busy"] == {0: m * (f + b), 1: m * (f + b)}
    # a blocking send whose receive is posted late holds the sender; a posted one does not
    late = [("ForwardPass", 1.0), ("RecvActivation", 0.0), ("ForwardPass", 1.0)]
    blocking = {0: [("SendActivation", 0.0), ("ForwardPass", 1.0)], 1: [("ForwardPass", 5.0), *late]}
    posted = {0: [("PostActivation", 0.0), ("ForwardPass", 1.0)], 1: [("ForwardPass", 5.0), *late]}
    assert replay(blocking)["busy"] == replay(posted)["busy"]
    assert replay(blocking)["finish"] == {0: 7.0, 1: 7.0}  # stage 0 waited for stage 1's receive at 6
    assert replay(posted)["finish"] == {0: 1.0, 1: 7.0}
