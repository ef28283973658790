"""Discrete choices that a correct layout can make the other way: top-k selections (MoE routing) decided by
less than the round-off of the scores they compare (bf16's, and below, fp32's).

A router picks each token's experts with `torch.topk` over its scores. Where the k-th and the (k+1)-th score
of a token lie closer together than bf16 moves them, a correct bf16 run may pick the (k+1)-th expert: a
discrete change, not a small one (the token's whole contribution moves from one expert's gradient to
another's, and its output changes downstream), so the shadow's distance (`dsx3d.verify.bf16_roundoff`), one
draw of bf16's round-off, does not cover it unless the shadow happens to flip the same tokens (CHANGELOG:
the generated MoE case that showed it).

So the reference records the inputs of every top-k call in its fp32 step, in the bf16 shadow and in the
propagated-change probes, takes per call the largest distance of a score from its fp32 value (the round-off
scale of that call's scores), and calls a selection undecided where its margin (k-th minus (k+1)-th score)
is within 2 x BF16_DRAWS of it: each of the two scores may move by BF16_DRAWS times the shadow's distance.
It then recomputes the fp32 step with the undecided selections taken the other way (the (k+1)-th instead of
the k-th): all of them, a random half, and the other half (flips of different tokens can cancel in one
element, as the propagated change's random and coherent probes do), and allows twice the largest change of
each gradient element, of the loss and of the norm. A selection decided by more than that is not forgiven.

fp32 has the same edge, narrower: a layout sums the hidden states in another order (tensor-parallel partial
sums, another reduction), so each router score moves by a few units in the last place, and a selection whose
margin is within that can go the other way (a generated Flint case at dp 2 x tp 2 had a margin of 6e-8 on
scores of 0.64, one ulp, and the run took the other expert). An fp32 run has no shadow to measure the scale
on, so it takes FP32_SCORE_ULPS units in the last place of each call's largest score (`fp32_spreads`) and
recomputes what those flips change in the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dsx3d.verify.bf16_roundoff import BF16_DRAWS

_TOPK = torch.topk
_TENSOR_TOPK = torch.Tensor.topk


@contextlib.contextmanager
def _topk_replaced(fn: Callable[..., object]) -> Iterator[None]:
    def method(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        return fn(self, *args, **kwargs)

    torch.topk, torch.Tensor.topk = fn, method  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = _TOPK, _TENSOR_TOPK  # type: ignore[method-assign]


def _decides(x: torch.Tensor, k: int, dim: int) -> bool:
    return x.is_floating_point() and x.dim() > 0 and 0 < k < x.shape[dim]


@contextlib.contextmanager
def recording(calls: list[torch.Tensor], choices: list[tuple[int, int, bool]] | None = None) -> Iterator[None]:
    """Append the input (fp32, detached) of every top-k call that makes a choice, in call order, and its
    (k, dim, largest) to `choices`."""

    def topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> object:
        if _decides(x, k, dim):
            calls.append(x.detach().float().clone())
            if choices is not None:
                choices.append((k, dim, largest))
        return _TOPK(x, k, dim=dim, largest=largest, sorted=sorted)

    with _topk_replaced(topk):
        yield


def score_spreads(ref: list[torch.Tensor], others: list[list[torch.Tensor]]) -> list[float]:
    """Per top-k call of the fp32 step: the largest distance of any score from its fp32 value over the other
    runs of the same step (a run with another sequence of calls says nothing and is left out)."""
    spreads = [0.0] * len(ref)
    for run in others:
        if len(run) != len(ref) or any(a.shape != b.shape for a, b in zip(run, ref, strict=True)):
            continue
        for i, (a, b) in enumerate(zip(run, ref, strict=True)):
            spreads[i] = max(spreads[i], float((a - b).abs().max()))
    return spreads


FP32_SCORE_ULPS = 16.0
"""fp32: the round-off scale of a router's scores in units in the last place of the call's largest score; a
selection is undecided within BF16_DRAWS times that (64 ulp, about 8e-6 of the largest score). Generous,
because what it forgives is recomputed, not assumed: a flip that does not explain a difference forgives
nothing."""


def _top_and_margin(x: torch.Tensor, k: int, dim: int, largest: bool) -> tuple[Any, torch.Tensor]:
    """The k + 1 best candidates along `dim` (moved last), and each selection's margin: k-th minus (k+1)-th."""
    top = _TOPK(x.detach().movedim(dim, -1), k + 1, dim=-1, largest=largest, sorted=True)
    return top, (top.values[..., k - 1] - top.values[..., k]).abs()


def fp32_spreads(calls: list[torch.Tensor], choices: list[tuple[int, int, bool]]) -> list[float]:
    """Per recorded top-k call of an fp32 step (`recording`'s inputs and choices): its round-off scale
    (FP32_SCORE_ULPS ulp of its largest score), or 0 where no selection of the call is within BF16_DRAWS times
    it, so that a step without an undecided selection is not recomputed."""
    eps = torch.finfo(torch.float32).eps
    spreads = []
    for x, (k, dim, largest) in zip(calls, choices, strict=True):
        spread = FP32_SCORE_ULPS * eps * float(x.abs().max())
        undecided = bool((_top_and_margin(x, k, dim, largest)[1] <= BF16_DRAWS * spread).any())
        spreads.append(spread if undecided else 0.0)
    return spreads


@contextlib.contextmanager
def flipping(spreads: list[float], choose: Callable[[int, torch.Size], torch.Tensor], flipped: list[int]) -> Iterator[None]:
    """Top-k calls (in the recorded order) take the (k+1)-th candidate instead of the k-th where their margin
    is within 2 x BF16_DRAWS x the call's spread and `choose(call, shape)` marks the row; `flipped` gets the
    count of each call."""
    counter = iter(range(1 << 30))

    def topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> object:
        if not _decides(x, k, dim):
            return _TOPK(x, k, dim=dim, largest=largest, sorted=sorted)
        i = next(counter)
        spread = spreads[i] if i < len(spreads) else 0.0
        with torch.no_grad():
            top, margin = _top_and_margin(x, k, dim, largest)
            take = (margin <= BF16_DRAWS * spread) & choose(i, margin.shape)
            index = top.indices[..., :k].clone()
            index[..., k - 1] = torch.where(take, top.indices[..., k], index[..., k - 1])
            index = index.movedim(-1, dim)
        flipped.append(int(take.sum()))
        return torch.return_types.topk((x.gather(dim, index), index))

    with _topk_replaced(topk):
        yield


def flip_change(
    spreads: list[float],
    accumulate: Callable[[], float],
    named: list[tuple[str, torch.nn.Parameter]],
    base_grads: dict[str, torch.Tensor],
    base_loss: float,
    seed: int,
) -> tuple[dict[str, torch.Tensor], float, float, int]:
    """Recompute the step (`accumulate` backpropagates it into .grad, returns the loss) with the undecided
    selections flipped: all, a random half, the other half. Returns per element the largest change of the
    gradient from `base_grads` (unclipped), the largest changes of the loss (from `base_loss`) and of the gradient norm over the
    probes, and how many selections were undecided. .grad is restored."""
    kept = {n: p.grad for n, p in named}
    base_norm = sum(float(g.double().pow(2).sum()) for g in base_grads.values()) ** 0.5
    halves: dict[int, torch.Tensor] = {}

    def half(i: int, shape: torch.Size, other: bool) -> torch.Tensor:
        if i not in halves:
            halves[i] = torch.rand(shape, generator=torch.Generator().manual_seed(seed * 7919 + i)) < 0.5
        return ~halves[i] if other else halves[i]

    probes: list[Callable[[int, torch.Size], torch.Tensor]] = [
        lambda i, shape: torch.ones(shape, dtype=torch.bool),
        lambda i, shape: half(i, shape, False),
        lambda i, shape: half(i, shape, True),
    ]
    change: dict[str, torch.Tensor] = {}
    loss_change, norm_change, undecided = 0.0, 0.0, 0
    for j, choose in enumerate(probes):
        flipped: list[int] = []
        for _, p in named:
            p.grad = None
        with flipping(spreads, choose, flipped):
            loss = accumulate()
        if j == 0:
            undecided = sum(flipped)
            if undecided == 0:
                break
        square = 0.0
        with torch.no_grad():
            for n, p in named:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                square += float(g.double().pow(2).sum())
                diff = (g - base_grads.get(n, torch.zeros_like(g))).abs()
                change[n] = diff if n not in change else torch.maximum(change[n], diff)
        loss_change = max(loss_change, abs(loss - base_loss))
        norm_change = max(norm_change, abs(square**0.5 - base_norm))
    for n, p in named:
        p.grad = kept[n]
    return change, loss_change, norm_change, undecided
