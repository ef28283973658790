"""`dsx3d verify --objective dpo`: DPO steps of the recipe face (`dsx3d.engine.preference_run`: the DPO objective and
the reference pass `dsx3d train` installs) under a generated layout, against DPO's math on one process (plain HF
models: the policy, and a frozen copy of its initial weights as the reference; TRL's pair losses, the pair mean
per micro-batch, the micro-batch mean per step).

The pairs are generated token ids (`preference_pairs`): prompts of different lengths, and chosen and rejected
completions of different lengths, so that padding, prompt masking and the per-sequence sums all matter. Compared,
as `dsx3d.verify.parity` compares language modelling: every step's loss, gradient norm and TRL's rewards/* and
logps/*, and with SGD every step's gradients (weight changes) tensor by tensor, with AdamW every step's weights
(each step taken by the reference from the weights the 3D run had before it).

`policy_as_reference` is the fault the check must catch: the reference pass computing with the policy's current
weights instead of the frozen ones (equal at step 1, wrong from step 2 on).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from dsx3d.data.preference import Pairs
from dsx3d.objectives.dpo_math import DPOLossConfig, pair_losses
from dsx3d.verify.case import CRITERIA, Check, ParityCase
from dsx3d.verify.parity import (
    SGD_LR,
    ParityResult,
    _adam_weight_check,
    _gradient_check,
    _relative_check,
    case_recipe,
)
from dsx3d.verify.reference import build_reference, hf_name, rename, run_reference, sgd_steps

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")
BETA = 0.5
"""Large enough that the rewards, and the loss's gradient, are far from zero after one step."""


def preference_pairs(case: ParityCase) -> list[Pairs]:
    """Per step, the global batch's pairs: prompts of 1 .. seq_len / 2 tokens, completions of 1 .. what is left,
    drawn separately for chosen and rejected (fixed by the seed)."""
    g = torch.Generator().manual_seed(case.seed + 2)
    vocab = case.config.get_text_config().vocab_size
    s = case.seq_len
    steps = []
    for _ in range(case.steps):
        ids = torch.zeros(case.global_batch, 2, s, dtype=torch.int32)
        labels = torch.full((case.global_batch, 2, s), -100, dtype=torch.int32)
        for i in range(case.global_batch):
            prompt = int(torch.randint(1, max(2, s // 2 + 1), (1,), generator=g))
            for side in range(2):
                n = prompt + int(torch.randint(1, s - prompt + 1, (1,), generator=g))
                ids[i, side, :n] = torch.randint(0, vocab, (n,), generator=g)
                ids[i, side, :prompt] = ids[i, 0, :prompt]
                labels[i, side, prompt:n] = ids[i, side, prompt:n]
        steps.append(Pairs(ids.numpy(), labels.numpy(), torch.full((case.global_batch, 2), float("nan")).double().numpy()))
    return steps


def _micro(case: ParityCase, pairs: Pairs, k: int, dp_rank: int) -> Any:
    first = (k * case.dp + dp_rank) * case.micro_batch_size
    return pairs.micro_batch(torch.arange(first, first + case.micro_batch_size).numpy())


@contextlib.contextmanager
def policy_as_reference() -> Iterator[None]:
    """The fault: the reference pass runs with the policy's current weights."""
    from dsx3d.engine.reference import Reference

    original = Reference.weights
    Reference.weights = lambda self: contextlib.nullcontext()  # type: ignore[assignment,method-assign,misc,return-value]
    try:
        yield
    finally:
        Reference.weights = original  # type: ignore[method-assign]


FAULTS = {"policy_as_reference": policy_as_reference}


def _rank_worker(rank: int, case: ParityCase, state: dict[str, torch.Tensor], steps: list[Pairs], fault: str | None) -> dict[str, Any]:
    from dsx3d.engine.builder import build_engine
    from dsx3d.engine.preference_run import PreferenceTraining
    from dsx3d.models.weights import StateDictSource
    from dsx3d.verify.parity import case_ds_overrides

    recipe = dpo_recipe(case)
    engine = build_engine(recipe, hf_config=case.config, source=StateDictSource(state), ds_overrides=case_ds_overrides(case))
    dpo = PreferenceTraining(engine, recipe, precomputed=False)
    out: dict[str, Any] = {"losses": [], "norms": [], "metrics": [], "shards": []}
    with FAULTS[fault]() if fault else contextlib.nullcontext():
        for pairs in steps:
            loss, metrics = dpo.train_step([_micro(case, pairs, k, engine.placement.dp) for k in range(case.micro_batches)])
            out["losses"].append(loss)
            out["norms"].append(engine.grad_norm)
            out["metrics"].append(metrics)
            out["shards"].append(engine.hf_shards())
    return out


def dpo_recipe(case: ParityCase) -> Any:
    recipe = case_recipe(case)
    train = recipe.train.model_copy(update={"objective": "dpo", "dpo": recipe.train.dpo.model_copy(update={"beta": BETA})})
    return recipe.model_copy(update={"train": train, "data": recipe.data.model_copy(update={"format": "preference"})})


def _reference_side(case: ParityCase, model: torch.nn.Module, steps: list[Pairs], replay: list[Any]) -> tuple[Any, list[dict[str, float]]]:
    """run_reference with DPO's loss: the frozen reference is a copy of the model before the first step."""
    frozen = copy.deepcopy(model).eval()
    config = DPOLossConfig(beta=BETA)
    metrics: dict[int, dict[str, float]] = {}
    """Per step (its pairs), the metrics of its first pass: a recomputation with top-k ties flipped
    (dsx3d.verify.topk_ties) runs the step again."""

    def sums(m: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=ids).logits[:, :-1].float()
        target = labels[:, 1:]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (logp * (target != -100)).sum(dim=1)

    def accumulate(case: ParityCase, model: torch.nn.Module, pairs: Pairs) -> float:
        n_micro = case.micro_batches * case.dp
        total, rows = 0.0, []
        for k in range(case.micro_batches):
            for d in range(case.dp):
                ids, (labels, _norm, _ref, tokens) = _micro(case, pairs, k, d)
                p = case.micro_batch_size
                with torch.no_grad():
                    ref = sums(frozen, ids, labels).double()
                pol = sums(model, ids, labels)
                losses = pair_losses(config, pol[:p], pol[p:], ref[:p].float(), ref[p:].float(), tokens[:p].float(), tokens[p:].float())
                loss = losses.mean()
                (loss / n_micro).backward()
                total += float(loss.detach()) / n_micro
                rc, rr = BETA * (pol[:p].detach().double() - ref[:p]), BETA * (pol[p:].detach().double() - ref[p:])
                rows.append(torch.stack([rc, rr, rc - rr, (rc > rr).double(), pol[:p].detach().double(), pol[p:].detach().double()]))
        every = torch.cat(rows, dim=1).mean(dim=1)
        metrics.setdefault(id(pairs), dict(zip(METRICS, every.tolist(), strict=True)))
        return total

    return run_reference(case, model, steps, accumulate=accumulate, replay=replay), list(metrics.values())


def run_dpo_parity(case: ParityCase, model: torch.nn.Module | None = None, timeout_s: float = 300.0, fault: str | None = None) -> ParityResult:
    """DPO steps both ways from the same weights and pairs (module docstring)."""
    import time

    from dsx3d.models.shards import merge_shards
    from dsx3d.verify.harness import run_ranks

    model = build_reference(case) if model is None else model.float()
    state = {hf_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    initial = {hf_name(n): p.detach().clone() for n, p in model.named_parameters()}
    vocab = case.config.get_text_config().vocab_size
    sizes = {name: vocab for name, t in initial.items() if t.dim() >= 1 and t.shape[0] == vocab}
    steps = preference_pairs(case)
    t0 = time.perf_counter()
    results = run_ranks(_rank_worker, case.world_size, case, state, steps, fault, timeout_s=timeout_s)
    t1 = time.perf_counter()
    merged = [merge_shards([r["shards"][i] for r in results], sizes) for i in range(case.steps)]
    names = {n: hf_name(n) for n, p in model.named_parameters() if p.requires_grad}
    replay = [None if w is None else {n: w[h] for n, h in names.items()} for w in [None, *merged[:-1]]]
    ref, ref_metrics = _reference_side(case, model, steps, replay)
    seconds_ref = time.perf_counter() - t1
    rename(ref, hf_name)
    criteria = CRITERIA[case.dtype]
    got = results[0]
    checks = [
        _relative_check("loss", ref.losses, got["losses"], criteria.loss_rtol, ref.loss_slack),
        _relative_check("grad_norm", ref.norms, got["norms"], criteria.norm_rtol, ref.norm_slack),
    ]
    for name in METRICS:  # rewards and log-prob sums: relative to max(1, |value|), as the loss
        checks.append(_relative_check(name, [m[name] for m in ref_metrics], [m[name] for m in got["metrics"]], 1e-4))
    if case.optimizer == "sgd":
        checks.append(_gradient_check(sgd_steps(ref), [initial, *merged[:-1]], merged, criteria, ref.update_slack))
    else:
        labels = [f"step {t + 1}" for t in range(case.steps)]
        pairs = [(r, g, a, CRITERIA["fp32"].stored_u) for r, g, a in zip(ref.snapshots, merged, ref.adam_slack, strict=True)]
        checks.append(_adam_weight_check(pairs, criteria, labels))
    worst, worst_name = 0.0, ""
    for name, tensor in merged[-1].items():
        if name in ref.snapshots[-1]:
            diff = (tensor - ref.snapshots[-1][name].float()).abs().max().item()
            worst, worst_name = (diff, name) if diff > worst else (worst, worst_name)
    return ParityResult(
        layout={"dp": case.dp, "cp": case.cp, "tp": case.tp, "pp": case.pp, "ep": case.ep, "zero_stage": case.zero_stage},
        optimizer=case.optimizer, losses_ref=ref.losses, losses_3d=got["losses"], grad_norms_ref=ref.norms,
        grad_norms_3d=got["norms"], max_abs_loss_diff=max(abs(a - b) for a, b in zip(ref.losses, got["losses"], strict=True)),
        max_abs_grad_norm_diff=max(abs(a - b) for a, b in zip(ref.norms, got["norms"], strict=True)),
        max_abs_param_diff=worst, worst_param=worst_name, seconds_ref=seconds_ref, seconds_3d=t1 - t0,
        checks=checks, ok=all(c.ok for c in checks),
    )  # fmt: skip


def run_dpo_verify(case: ParityCase, model: torch.nn.Module | None = None, timeout_s: float = 300.0, fault: str | None = None) -> list[ParityResult]:
    """The gradients through an SGD run, then AdamW's weights, as `dsx3d verify` does for language modelling."""
    state = None if model is None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = []
    for optimizer in ("sgd", "adamw"):
        if model is not None:
            model.load_state_dict(state)  # type: ignore[arg-type]
        lr = SGD_LR if optimizer == "sgd" else case.lr
        out.append(run_dpo_parity(replace(case, optimizer=optimizer, lr=lr), model=model, timeout_s=timeout_s, fault=fault))
    return out


__all__ = ["FAULTS", "Check", "preference_pairs", "run_dpo_parity", "run_dpo_verify"]
