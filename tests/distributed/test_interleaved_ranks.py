"""Interleaved 1F1B's order on 2 gloo ranks with real point-to-point messages (`dsx3d.distributed.tagged_p2p`):
each rank runs only its own program (`dsx3d.pipeline.interleaved.rank_program`) on its two chunks of a tiny Llama
(chunk c of rank r is stage 2c + r), posting its sends and blocking on tagged receives, the wrap-around link from
rank 1's chunk 0 to rank 0's chunk 1 included. Nothing deadlocks, and the loss and every gradient equal one plain
HF forward and backward. (A plain torch runtime of the order; the runtime inside DeepSpeed's PipelineEngine is
tested by test_interleaved_engine.py.)"""

from __future__ import annotations

import pytest
import torch

from dsx3d.distributed.tagged_p2p import TaggedLinks
from dsx3d.pipeline.interleaved import VIRTUAL_STAGES, rank_program
from dsx3d.verify.harness import run_ranks
from tests.helpers.interleaved import model as tiny_model
from tests.helpers.interleaved import reference, stage_forward

PP, M = 2, 4


def _micro(vocab: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randint(0, vocab, (2, 16)) for _ in range(M)]


def _worker(rank: int, swap: bool) -> dict[str, object]:
    model = tiny_model()
    micro = _micro(model.config.vocab_size)
    stages, links = VIRTUAL_STAGES * PP, TaggedLinks()
    hidden = model.config.hidden_size
    like = torch.zeros(2, 16, hidden)
    held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    losses = []
    for op in rank_program(rank, PP, M):
        s, j = op.chunk * PP + rank, op.micro_batch
        if op.kind == "F":
            if s == 0:
                x = micro[j]
            elif swap and s == PP and j < 2:  # the fault: chunk 1 takes micro-batches 0 and 1 the other way round
                if j == 0:
                    stash = links.recv(like, PP - 1, tag=2 * s)
                x = (links.recv(like, PP - 1, tag=2 * s) if j == 0 else stash).requires_grad_()
            else:  # stream tag: 2 x receiving stage (activations)
                x = links.recv(like, (rank - 1) % PP, tag=2 * s).requires_grad_()
            y = stage_forward(model, s, stages, x, micro[j])
            held[(s, j)] = (x, y)
            if s < stages - 1:
                links.post(y.detach(), (rank + 1) % PP, tag=2 * (s + 1))
            else:
                losses.append(float(y.detach()))
        else:
            x, y = held.pop((s, j))
            if s == stages - 1:
                (y / M).backward()
            else:  # stream tag: 2 x receiving stage + 1 (gradients)
                y.backward(links.recv(like, (rank + 1) % PP, tag=2 * s + 1))
            if s > 0:
                links.post(x.grad, (rank - 1) % PP, tag=2 * (s - 1) + 1)
    links.wait()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"losses": losses, "grads": grads}


def _run(swap: bool) -> tuple[float, float, float]:
    results = run_ranks(_worker, PP, swap, timeout_s=300.0)
    model = tiny_model()
    ref_loss = reference(model, _micro(model.config.vocab_size))
    ref = {n: p.grad for n, p in model.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for r in results:
        for name, g in r["grads"].items():  # type: ignore[attr-defined]
            assert name not in got, f"{name} has a gradient on two ranks"
            got[name] = g
    assert set(got) == set(ref)
    worst = max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
    losses = results[PP - 1]["losses"]
    return ref_loss, sum(losses) / M, worst  # type: ignore[arg-type]


def test_interleaved_on_two_gloo_ranks_gives_hfs_loss_and_gradients() -> None:
    ref_loss, loss, worst = _run(swap=False)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert worst < 1e-5


def test_a_micro_batch_swap_between_chunks_is_caught() -> None:
    """Rank 0's chunk 1 takes micro-batch 1's activation for micro-batch 0 and the reverse (wrap-around link)."""
    ref_loss, loss, worst = _run(swap=True)
    assert worst > 1e-3 or abs(loss - ref_loss) > 1e-4
