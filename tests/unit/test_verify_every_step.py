"""The verify reference's record of every step (dsx3d.verify.reference).

Found on the seed-2077 sweep: with every step replayed from the parallel run's weights, the SGD gradient check
compared step t's change as snapshots[t + 1] - snapshots[t], and snapshots[t + 1] was the parallel run's own
weights after step t, not the reference's. Every step but the last compared the parallel run with itself. A
generated Flint case (fp32, dp 2 x tp 2, ZeRO-3) had a routing choice that fp32 round-off took the other way in
step 1; the SGD run passed and the AdamW run failed, which hid the cause.
"""

from __future__ import annotations

import torch

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.case import CRITERIA, ParityCase
from dsx3d.verify.parity import _gradient_check
from dsx3d.verify.reference import run_reference, sgd_steps

LR = 0.5


class Router(torch.nn.Module):
    """Scores over four experts, each token to its top 2, an expert a linear map."""

    def __init__(self, router: torch.Tensor) -> None:
        super().__init__()
        self.router = torch.nn.Parameter(router)
        self.experts = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4 * 3 * 2).reshape(4, 3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ self.router
        weight, index = torch.topk(scores, 2, dim=-1)
        out = torch.einsum("tk,tkd->td", weight, torch.einsum("td,tkde->tke", x, self.experts[index]))
        return out.pow(2).mean()


def _case() -> ParityCase:
    return ParityCase(tiny_config("llama"), steps=2, optimizer="sgd", lr=LR, grad_clip=0.0)


def _accumulate(case: ParityCase, model: torch.nn.Module, batch: torch.Tensor) -> float:
    loss = model(batch)
    loss.backward()
    return float(loss.detach())


def _batches() -> list[torch.Tensor]:
    return [torch.tensor([[1.0, 0.5, -0.25], [0.3, -1.0, 0.7]]), torch.tensor([[0.2, 0.1, 0.9], [-0.6, 0.4, 0.1]])]


def _router(tie: bool) -> torch.Tensor:
    """Experts 1 and 2 score alike (every token's 2nd and 3rd score tie: fp32 can take either) or 0.5 apart."""
    r = torch.zeros(3, 4)
    r[:, 0] = 2.0
    r[:, 1] = torch.tensor([0.1, 0.2, 0.3])
    r[:, 2] = r[:, 1] - (0.0 if tie else 0.5)
    r[:, 3] = -5.0
    return r


def test_each_sgd_step_is_the_references_own() -> None:
    """With step 2 replayed from other weights, step 1's reference change is still its own."""
    case, model = _case(), Router(_router(tie=False))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    elsewhere = {n: t + 0.125 for n, t in start.items()}
    ref = run_reference(case, model, _batches(), accumulate=_accumulate, replay=[None, elsewhere])
    (s1, a1), (s2, a2) = sgd_steps(ref)
    assert all(torch.equal(s1[n], start[n]) and torch.equal(s2[n], elsewhere[n]) for n in start)
    assert not torch.equal(a1["experts"], s2["experts"])  # the reference's own step 1 ended elsewhere

    # a parallel run that took another step 1 and then its step 2 correctly from there: step 1 fails
    wrong = {n: start[n] - 2 * (a1[n] - start[n]) for n in start}  # the update reversed and doubled
    after_2 = {n: elsewhere[n] + (a2[n] - s2[n]) for n in start}
    check = _gradient_check(sgd_steps(ref), [start, elsewhere], [wrong, after_2], CRITERIA["fp32"])
    assert not check.ok and check.where.startswith("step 1")
    assert _gradient_check(sgd_steps(ref), [start, elsewhere], [a1, after_2], CRITERIA["fp32"]).ok


def test_an_fp32_routing_tie_is_recomputed_flipped_and_allowed() -> None:
    """A top-k choice decided by less than fp32's round-off gets the flipped step's change as its allowance;
    a decided one gets nothing and is not recomputed."""
    case = _case()
    tied = run_reference(case, Router(_router(tie=True)), _batches(), accumulate=_accumulate)
    assert tied.undecided[0] >= 1
    assert tied.update_slack[0].get("experts", 0.0) > 0 and tied.loss_slack[0] > 0
    decided = run_reference(case, Router(_router(tie=False)), _batches(), accumulate=_accumulate)
    assert decided.undecided == [] and decided.update_slack == [{}, {}] and decided.loss_slack == [0.0, 0.0]
