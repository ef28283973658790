"""Top-k choices a correct layout can make the other way (dsx3d.verify.topk_ties): a selection whose margin lies within
BF16_DRAWS times its call's score round-off is taken the other way by the flip probes, a decided one never;
the recorder sees every choosing top-k call, through torch.topk and Tensor.topk alike."""

from __future__ import annotations

import pytest
import torch

from dsx3d.verify.bf16_roundoff import BF16_DRAWS
from dsx3d.verify.topk_ties import FP32_SCORE_ULPS, flipping, fp32_spreads, recording, score_spreads

SCORES = torch.tensor(
    [
        [0.50, 0.30, 0.299, 0.10],  # 2nd and 3rd 1e-3 apart: undecided at a spread of 1e-3
        [0.50, 0.30, 0.200, 0.10],  # 0.1 apart: decided
    ],
    requires_grad=True,
)


def _all(i: int, shape: torch.Size) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool)


def test_only_the_undecided_selection_flips() -> None:
    flipped: list[int] = []
    with flipping([1e-3], _all, flipped):
        values, index = torch.topk(SCORES, 2, dim=-1)
    assert index.tolist() == [[0, 2], [0, 1]] and flipped == [1]
    values.sum().backward()  # the chosen scores still carry their gradient
    assert SCORES.grad is not None and SCORES.grad[0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert torch.topk(SCORES, 2).indices.tolist() == [[0, 1], [0, 1]]  # restored on exit


def test_the_margin_is_bf16_draws_times_the_spread() -> None:
    margin = 1e-3
    for spread, flips in ((margin / BF16_DRAWS * 1.01, 1), (margin / BF16_DRAWS * 0.99, 0)):
        flipped: list[int] = []
        with flipping([spread], _all, flipped):
            SCORES.detach().topk(2, dim=1)
        assert flipped == [flips], (spread, flipped)


def test_fp32_nothing_flips_and_no_choice_is_not_recorded() -> None:
    flipped: list[int] = []
    with flipping([0.0], _all, flipped):
        assert torch.topk(SCORES, 2).indices.tolist() == [[0, 1], [0, 1]]
    calls: list[torch.Tensor] = []
    with recording(calls):
        torch.topk(SCORES, 4)  # every element: no choice
        SCORES.detach().to(torch.bfloat16).topk(1)
        torch.topk(torch.arange(4), 2)  # integers: no scores
    assert len(calls) == 1 and calls[0].dtype == torch.float32


def test_spreads_are_per_call_and_skip_a_run_of_other_calls() -> None:
    ref = [torch.zeros(2, 4), torch.zeros(3)]
    shadow = [torch.full((2, 4), 1e-3), torch.tensor([0.0, -2e-3, 0.0])]
    other = [torch.ones(5)]  # another sequence of calls: says nothing
    assert score_spreads(ref, [shadow, other]) == pytest.approx([1e-3, 2e-3])


def test_fp32_spreads_only_for_a_call_with_a_margin_within_64_ulp() -> None:
    calls: list[torch.Tensor] = []
    choices: list[tuple[int, int, bool]] = []
    tie = torch.tensor([[0.64, 0.5, 0.5 - 2**-24, 0.1]])  # 2nd and 3rd one ulp apart
    with recording(calls, choices):
        tie.topk(2, dim=1)
        torch.topk(SCORES.detach(), 2)  # 1e-3 apart at best: decided in fp32
        torch.topk(tie.t(), 1, dim=0, largest=False)
    assert choices == [(2, 1, True), (2, -1, True), (1, 0, False)]
    spreads = fp32_spreads(calls, choices)
    assert spreads[0] == pytest.approx(FP32_SCORE_ULPS * torch.finfo(torch.float32).eps * 0.64)
    assert spreads[1] == 0.0 and spreads[2] == 0.0  # smallest two of the column: 0.1 and 0.5 - 2^-24, decided
