"""DPO under `dsx3d train` (`train.objective: dpo`): the objective (dsx3d.objectives.dpo) and the reference pass
(dsx3d.engine.reference) the Trainer face uses, installed on the recipe's engine; a training step with TRL's
metrics, and an evaluation on held-out pairs.

Per step: the reference's log-prob sums of exactly the step's micro-batches (a forward-only pass on the same
pipeline, unless precomputed), then one pipeline step whose last stage computes the pair losses, and TRL's metrics
of the step: each micro-batch slot's `rewards/*`, `logps/*`, `logits/*`, `entropy`, `mean_token_accuracy` over the
DP ranks, averaged over the slots (what DPOTrainer logs for one step), and `num_tokens` (prompt and completion
tokens of both sides, so far).

Evaluation: for every held-out global batch, the reference's and the policy's sums (two forward-only passes), then
the pair losses and rewards on the last stage; `eval_loss` and `eval_rewards/*`, `eval_logps/*` are means over
every held-out pair (padding pairs count in none).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from dsx3d.distributed import comm
from dsx3d.engine.builder import Engine3D, MicroBatch
from dsx3d.engine.reference import Reference
from dsx3d.engine.stage_loss import install_objective_loss
from dsx3d.errors import UserError
from dsx3d.objectives.dpo import DirectPreference, record_preference_metrics
from dsx3d.objectives.dpo_math import DPOLossConfig, pair_losses
from dsx3d.recipe.schema import Recipe


def loss_config(recipe: Recipe) -> DPOLossConfig:
    dpo = recipe.train.dpo
    weights = tuple(float(w) for w in dpo.loss_weights) if dpo.loss_weights is not None else None
    return DPOLossConfig(beta=float(dpo.beta), loss_type=tuple(dpo.loss_type), loss_weights=weights, label_smoothing=dpo.label_smoothing)


def reference_mode(recipe: Recipe, precomputed: bool) -> str:
    """train.dpo.reference with `auto` resolved; `precomputed`: the training data carries TRL's ref_*_logps."""
    mode = recipe.train.dpo.reference
    if mode == "precomputed" and not precomputed:
        raise UserError.single(
            "train.dpo.reference", mode, f"{recipe.data.source} has no ref_chosen_logps and ref_rejected_logps columns "
            "(or some are missing)", "add both columns to every record, or set train.dpo.reference: auto",
        )  # fmt: skip
    if mode != "auto":
        return mode
    if precomputed:
        return "precomputed"
    lora = recipe.model.lora
    return "adapters_off" if lora is not None and lora.init_lora_weights and lora.peft_config is None else "copy"


class PreferenceTraining:
    """Build right after the engine, before any step or resume (the frozen copy is the initial weights)."""

    def __init__(self, engine: Engine3D, recipe: Recipe, precomputed: bool):
        self.engine, self.recipe = engine, recipe
        self.objective = DirectPreference(loss_config(recipe))
        self.loss = install_objective_loss(engine, self.objective)
        self.mode = reference_mode(recipe, precomputed)
        self.reference = Reference(engine, self.loss, self.mode)
        self.tokens = 0

    @property
    def _contributes(self) -> bool:
        return self.engine.placement.tp == 0

    def train_step(self, micro: list[MicroBatch]) -> tuple[float, dict[str, float]]:
        """One optimizer step: (loss, TRL's metrics of the step). A collective over every rank."""
        micro = self.reference.fill(micro)
        self.loss.training, self.loss.stats = True, []
        try:
            loss = self.engine.train_step(iter(micro))
            stats = list(self.loss.stats)
        finally:
            self.loss.stats = None
        metrics: dict[str, list[float]] = defaultdict(list)
        record_preference_metrics(metrics, stats, len(micro), self._contributes)
        self.tokens += self._dp_tokens(micro)
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out["num_tokens"] = float(self.tokens)
        return loss, out

    def _dp_tokens(self, micro: list[MicroBatch]) -> int:
        """Prompt and completion tokens of the step's real rows over the DP ranks (TRL's num_tokens)."""
        local = 0
        for _, (labels, _norm, _ref, tokens) in micro:
            real = tokens >= 0
            scored = labels[real] != -100
            last = scored.shape[1] - scored.flip(1).to(torch.int8).argmax(dim=1)
            local += int(last.sum())
        layout = self.engine.layout
        total = comm.all_reduce_sum(torch.tensor([local], dtype=torch.int64))
        return int(total.item()) // (layout.tp * layout.pp * layout.cp)

    def evaluate(self, batches: Any) -> dict[str, float]:
        """eval_loss and eval_rewards/*, eval_logps/* over the held-out pairs (module docstring). A collective."""
        sums = torch.zeros(8, dtype=torch.float64)
        last = self.engine.holds_loss
        for b in range(batches.num_batches):
            micro = self.reference.fill(batches.batch(b))  # the reference's sums in the labels (last stage)
            policy = self.reference.sums(micro, reference=False)
            if policy is None or not (last and self._contributes and self.engine.placement.cp == 0):
                continue
            for k, (_, (_labels, _norm, ref, tokens)) in enumerate(micro):
                sums += self._eval_sums(policy[k].double().cpu(), ref, tokens)
        total = comm.all_reduce_sum(sums)
        n = max(float(total[0]), 1.0)
        names = ["eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
                 "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"]  # fmt: skip
        return {name: float(total[i + 1]) / n for i, name in enumerate(names)}

    def _eval_sums(self, policy: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        pairs = tokens.shape[0] // 2
        real = (tokens[:pairs] >= 0).double()
        pc, pr, rc, rr = policy[:pairs], policy[pairs:], ref[:pairs], ref[pairs:]
        losses = pair_losses(self.objective.config, pc, pr, rc, rr, tokens[:pairs], tokens[pairs:])
        beta = self.objective.config.beta
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)

        def total(x: torch.Tensor) -> torch.Tensor:
            return (torch.nan_to_num(x) * real).sum()

        return torch.stack([real.sum(), total(losses), total(chosen), total(rejected), total((chosen > rejected).double()),
                            total(chosen - rejected), total(pc), total(pr)])  # fmt: skip

