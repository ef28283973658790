"""The single-process reference of a parity case: plain HF on the same batches, its losses, gradients and weight changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dsx3d.verify.bf16_roundoff import (
    BF16_DRAWS,
    Bf16Roundoff,
    bf16_shadow,
    record_step,
)
from dsx3d.verify.case import CRITERIA, ParityCase, micro_batch
from dsx3d.verify.reference_clip import clip_by_exact_norm
from dsx3d.verify.topk_ties import flip_change, fp32_spreads, recording, score_spreads


def build_reference(case: ParityCase) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(case.seed)
    model = AutoModelForCausalLM.from_config(case.config)
    if case.lora is not None:
        from peft import get_peft_model

        from dsx3d.models.lora import peft_config_from
        from dsx3d.recipe.schema import LoraSection

        model = get_peft_model(model, peft_config_from(LoraSection(**case.lora)))
    return model.float()


def hf_name(name: str) -> str:
    """A reference parameter's name as the 3D side calls it (`dsx3d.models.lora.hf_param_name`)."""
    from dsx3d.models.lora import hf_param_name

    return hf_param_name(name)


@dataclass
class Reference:
    losses: list[float]
    norms: list[float]
    snapshots: list[dict[str, torch.Tensor]]
    """Parameters before each step and after the last (SGD), or after each step (AdamW)."""
    after: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """SGD: the parameters after each step, from the ones it took that step from (snapshots[t]). With `replay`
    the next step starts from the parallel run's weights, so snapshots[t + 1] is not this run's own result."""
    adam_slack: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """AdamW, per step: per element, how far round-off amplified by Adam can move a weight in that step
    (module docstring of dsx3d.verify.parity)."""
    loss_slack: list[float] = field(default_factory=list)
    norm_slack: list[float] = field(default_factory=list)
    """Per step: how much bf16 (dsx3d.verify.bf16_roundoff, dsx3d.verify.topk_ties) can change the loss and
    the gradient norm."""
    update_slack: list[dict[str, float]] = field(default_factory=list)
    """SGD in bf16, per step and tensor: how far bf16 round-off moves the weight change (dsx3d.verify.bf16_roundoff)."""
    undecided: list[int] = field(default_factory=list)
    """bf16, per step with top-k choices: how many were within bf16's round-off (dsx3d.verify.topk_ties)."""


def rename(ref: Reference, name: Callable[[str], str]) -> None:
    """Every per-parameter record of `ref` keyed by `name(parameter)`."""
    ref.snapshots = [{name(n): t for n, t in step.items()} for step in ref.snapshots]
    ref.after = [{name(n): t for n, t in step.items()} for step in ref.after]
    ref.adam_slack = [{name(n): t for n, t in step.items()} for step in ref.adam_slack]
    ref.update_slack = [{name(n): d for n, d in step.items()} for step in ref.update_slack]


def sgd_steps(ref: Reference) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """SGD: per step, (the weights the reference took it from, its own weights after it)."""
    return list(zip(ref.snapshots[:-1], ref.after, strict=True))


def _optimizer(case: ParityCase, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr, momentum=0.0, weight_decay=0.0)
    return torch.optim.AdamW(
        params, lr=case.lr, betas=case.betas, eps=case.adam_eps, weight_decay=case.weight_decay
    )


def _accumulate_grads(
    case: ParityCase, model: torch.nn.Module, batch: torch.Tensor, token_losses: list[torch.Tensor] | None = None
) -> float:
    """Backward of the mean loss over the global batch `batch` into .grad; return that loss. `token_losses`:
    appended, per micro-batch, the cross-entropy of every scored token (fp32, detached)."""
    n_micro = case.micro_batches * case.dp
    total = 0.0
    for k in range(case.micro_batches):
        for d in range(case.dp):
            ids = micro_batch(case, batch, k, d)
            out = model(input_ids=ids, labels=ids)
            loss = out.loss
            (loss / n_micro).backward()
            total += loss.item() / n_micro
            if token_losses is not None:
                logits = out.logits.detach()[:, :-1].float()
                token_losses.append(
                    torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
                    )
                )
    return total


def token_roundoff(ref: list[torch.Tensor], shadow: list[torch.Tensor]) -> float:
    """The loss's bf16 round-off without cancellation: the mean over micro-batches of each micro-batch's mean
    |token loss (shadow) - token loss (reference)|. A bound on the loss's distance whatever the signs, where
    the distance of the two means is one signed draw that can cancel by chance."""
    if not ref or len(ref) != len(shadow):
        return 0.0
    return sum(float((s.double() - r.double()).abs().mean()) for r, s in zip(ref, shadow, strict=True)) / len(ref)


def run_reference(
    case: ParityCase,
    model: torch.nn.Module,
    batches: Any,
    accumulate: Callable[..., float] = _accumulate_grads,
    replay: list[dict[str, torch.Tensor] | None] | None = None,
) -> Reference:
    """Plain HF on one process: mean loss over the global batch, global-norm clipping, the optimizer.
    `accumulate(case, model, batch)` backpropagates one step's loss and returns it (default: `batches` of
    token ids, each sequence its own example). `replay[t - 1]` (parameter names as in `model`; None: the
    model's own): the weights the parallel run took step t from, from which this run takes it too (its
    optimizer state carries on), so that every step is compared from the same weights (module docstring of
    parity)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = _optimizer(case, [p for _, p in named])
    criteria = CRITERIA[case.dtype]
    ref = Reference([], [], [])
    v = {n: torch.zeros_like(p) for n, p in named}
    slack = {n: torch.zeros_like(p) for n, p in named}
    beta2 = case.betas[1]
    model.train()
    # bf16: the shadow runs from the reference's weights (with `replay`, the parallel run's); its loss distance
    # and per-token bound of every step, for the loss allowance after the last step
    loss_draws: list[float] = []
    token_bounds: list[float] = []
    for t, batch in enumerate(batches, start=1):
        start = replay[t - 1] if replay is not None else None
        if start is not None:
            with torch.no_grad():
                for n, p in named:
                    p.copy_(start[n])
        if case.optimizer == "sgd":
            ref.snapshots.append({n: p.detach().clone() for n, p in named})
        opt.zero_grad(set_to_none=True)
        rng = torch.get_rng_state()
        # the inputs of every top-k choice, in this step and (bf16) in the shadow (dsx3d.verify.topk_ties)
        ref_calls: list[torch.Tensor] = []
        choices: list[tuple[int, int, bool]] = []
        shadow_calls: list[torch.Tensor] = []
        ref_tokens: list[torch.Tensor] = []
        shadow_tokens: list[torch.Tensor] = []
        with recording(ref_calls, choices):
            if case.dtype == "bf16" and accumulate is _accumulate_grads:
                total = _accumulate_grads(case, model, batch, ref_tokens)
            else:
                total = accumulate(case, model, batch)
        after = torch.get_rng_state()
        max_norm = case.grad_clip if case.grad_clip > 0 else float("inf")
        unclipped = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
        norm = clip_by_exact_norm([p for _, p in named], max_norm)
        ref.loss_slack.append(0.0)
        ref.norm_slack.append(0.0)
        clip = min(1.0, max_norm / (float(norm) + 1e-6))
        bf16_grad: dict[str, torch.Tensor] = {}
        flipped: dict[str, torch.Tensor] = {}
        if case.dtype == "bf16":
            torch.set_rng_state(rng)
            with recording(shadow_calls):
                shadow_loss, shadow_grads = bf16_shadow(
                    model, lambda m: _accumulate_grads(case, m, batch, shadow_tokens), case.tp  # noqa: B023
                )
            rf = Bf16Roundoff()
            record_step(rf, total, norm, unclipped, shadow_loss, shadow_grads, case.lr, max_norm)
            loss_draws.append(rf.loss[0])
            token_bounds.append(token_roundoff(ref_tokens, shadow_tokens))
            ref.norm_slack[-1] += BF16_DRAWS * rf.norm[0]
            ref.update_slack.append({n: BF16_DRAWS * d for n, d in rf.update[0].items()})
            bf16_grad = rf.grad[0]
            spreads = score_spreads(ref_calls, [shadow_calls])
        else:
            ref.update_slack.append({})
            spreads = fp32_spreads(ref_calls, choices)
        if any(spreads):
            torch.set_rng_state(rng)
            flipped, flip_loss, flip_norm, undecided = flip_change(
                spreads, lambda: accumulate(case, model, batch), named, unclipped, total, case.seed * 1000 + t  # noqa: B023
            )
            ref.undecided.append(undecided)
            if undecided:
                ref.loss_slack[-1] += 2 * flip_loss
                ref.norm_slack[-1] += 2 * flip_norm
                for n, d in flipped.items():
                    ref.update_slack[-1][n] = ref.update_slack[-1].get(n, 0.0) + 2 * case.lr * clip * float(d.double().norm())
        torch.set_rng_state(after)
        if case.optimizer != "sgd":
            for n, p in named:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                v[n].mul_(beta2).add_(g * g, alpha=1 - beta2)
                v_hat = v[n] / (1 - beta2**t)
                delta = torch.full_like(p, criteria.roundoff * float(g.abs().max()) if g.numel() else 0.0)
                if n in flipped:
                    delta += 2 * clip * flipped[n]
                if n in bf16_grad and bf16_grad[n].numel():
                    # one draw of an element's round-off can be near zero by chance: the tensor's largest
                    delta += BF16_DRAWS * clip * float(bf16_grad[n].max())
                # this step's round-off, and the earlier steps' still held in Adam's moments; Adam moves an
                # element by at most a few lr per step, whatever its gradient
                slack[n] += (2 * case.lr * delta / (v_hat.sqrt() + case.adam_eps)).clamp(max=4 * case.lr)
            ref.adam_slack.append({n: s.clone() for n, s in slack.items()})
        opt.step()
        (ref.after if case.optimizer == "sgd" else ref.snapshots).append({n: p.detach().clone() for n, p in named})
        ref.losses.append(total)
        ref.norms.append(float(norm))
    if case.optimizer == "sgd":
        ref.snapshots.append({n: p.detach().clone() for n, p in named})
    if loss_draws:
        # one step's bf16 loss distance is a single scalar draw, a sum of signed round-offs that can cancel by
        # chance: every step is allowed the larger of the run's largest draw (BF16_DRAWS times) and its own
        # distance without cancellation (token_roundoff)
        largest = max(loss_draws)
        for t, bound in enumerate(token_bounds):
            ref.loss_slack[t] += max(BF16_DRAWS * largest, bound)
    return ref
