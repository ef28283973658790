"""What the pipeline's last stage computes from each micro-batch's logits for dsx3d.Trainer: the training loss
(HF's token weighting, or the user's `compute_loss_func`), the evaluation loss, and the predictions that
`compute_metrics` / `predict()` receive.

The last stage holds the logits vocab-sharded over its TP group: (b, s, V/tp) per rank, columns
[vocab_start, vocab_start + V/tp) of a vocabulary padded to a multiple of tp. The default loss needs no gather
(vocab-parallel cross-entropy), and neither do token predictions (`dsx3d.integrations.last_stage.argmax_logits`
as `preprocess_logits_for_metrics`: each rank's best column, then the best over ranks). A `compute_loss_func`,
any other `preprocess_logits_for_metrics`, or `compute_metrics` on raw logits see what they see under HF: the
full-vocabulary logits (b, s, V) of the micro-batch, gathered over the TP group (for the loss with a backward
that hands each rank the gradient of its own columns).

With context parallelism (cp > 1) each CP rank's last stage holds its slice of every sequence, and labels
arrive as (this slice's shifted targets, norm) (dsx3d.data.context_parallel): the loss is the engine's own, its norm set
by the Trainer for HF's token weighting, and what evaluation keeps is gathered over the CP group along the
sequence. A `compute_loss_func` and other `preprocess_logits_for_metrics` are refused there (they take HF's
unshifted labels of whole sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from dsx3d.distributed.context_parallel import CPContext
from dsx3d.engine.vocab_shard import VocabShard
from dsx3d.errors import Problem
from dsx3d.integrations.batches import count_targets
from dsx3d.integrations.label_smoothing import smoothed
from dsx3d.models.tiled_loss import HeadInputs
from dsx3d.objectives import LanguageModeling, Objective

Captured: TypeAlias = "torch.Tensor | tuple[Captured, ...] | list[Captured] | dict[str, Captured]"
"""What evaluation keeps of a micro-batch: logits, or what preprocess_logits_for_metrics made of them."""
Labels: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"
"""A micro-batch's labels, or with cp > 1 (this CP slice's shifted targets, norm)."""


def argmax_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`preprocess_logits_for_metrics` for token-level metrics: the predicted token id at every position,
    (b, s). Under dsx3d.Trainer it runs on the vocabulary shards without gathering them."""
    return logits.argmax(dim=-1)


class LastStageLoss:
    """The pipeline's loss function: called with each micro-batch's (logits shard, labels) on the last stage.

    DeepSpeed averages what it returns over the m micro-batches of a step and the dp ranks, so training returns
    the micro-batch's share of the step's loss times m * dp:
    - default: mean_k * n_k * m * dp / N, with n_k scored tokens in the micro-batch and N in the whole step
      (over DP ranks): the average is sum_k(n_k * mean_k) / N, the token-weighted mean HF trains on;
    - `compute_loss_func(outputs, labels, num_items_in_batch=N) * m * dp`: the sum of the function's values,
      as HF's Trainer trains with it (it multiplies by the number of processes, and DDP averages them).
    Evaluation returns the micro-batch's loss times its rows (0 for one that scores nothing): HF's evaluation
    loss is the mean of its batches' losses repeated per row (a batch scoring nothing is NaN there, and
    filtered); `capture` then keeps what compute_metrics needs."""

    def __init__(self, mean_loss: Callable[[torch.Tensor, Labels], torch.Tensor], shard: VocabShard,
                 compute_loss_func: Callable[..., torch.Tensor] | None = None):  # fmt: skip
        self.mean_loss, self.shard, self.compute_loss_func = mean_loss, shard, compute_loss_func
        self.training = True
        self.step_tokens = 1
        """N: scored tokens in the current optimizer step over all DP ranks."""
        self.scale = 1.0
        """m * dp: DeepSpeed's divisor."""
        self.capture: Callable[[torch.Tensor, torch.Tensor], Captured] | None = None
        self.captured: list[Captured] = []
        self.eval_rows: list[int] = []
        """Evaluation: the rows of each coming micro-batch's HF batch, taken in order (the Trainer sets them)."""
        self.stats: list[torch.Tensor] | None = None
        """When a list, training appends each micro-batch's statistics for the objective's metrics."""
        self.objective: Objective = LanguageModeling()
        """The training objective (`dsx3d.objectives`): what its metrics keep of each micro-batch; one with
        `own_loss` computes the whole loss (`Objective.last_stage_loss`, given this object)."""
        self.cp = CPContext()
        """This rank's CP group (set by `_install_loss`)."""
        self.reference_pass = False
        """An `own_loss` objective's forward-only reference pass: the loss returns per-sequence values."""
        self.label_smoothing = 0.0
        """TrainingArguments.label_smoothing_factor: HF's LabelSmoother on the default loss (not on compute_loss_func)."""

    def __call__(self, outputs: torch.Tensor, labels: Labels) -> torch.Tensor:
        """`outputs`: the logits shard, or under `train.loss_tile_tokens` what the tiled loss computes them from
        (`dsx3d.models.tiled_loss`); whatever needs the logits themselves gets them computed whole."""
        if self.objective.own_loss:
            return self.objective.last_stage_loss(outputs, labels, self)
        if isinstance(labels, tuple | list):
            return self._slice_loss(outputs, labels)
        if self.training:
            if self.stats is not None:
                self.stats.append(self.objective.step_statistics(whole_logits(outputs), labels, self.shard))
            if self.compute_loss_func is None:
                return self._mean(outputs, labels) * (count_targets(labels) * self.scale / max(self.step_tokens, 1))
            return self._user_loss(whole_logits(outputs), labels, self.step_tokens) * self.scale
        n = count_targets(labels)
        if self.compute_loss_func is None:
            loss = self._mean(outputs, labels)
        else:
            loss = self._user_loss(whole_logits(outputs), labels, n)
        if self.capture is not None:
            self.captured.append(self.capture(whole_logits(outputs), labels))
        weight = self.eval_rows.pop(0) if self.eval_rows else 1
        return loss * weight if n > 0 else loss * 0  # a batch scoring nothing: NaN under HF, filtered out

    def _mean(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss over its scored tokens: the engine's cross-entropy, label-smoothed as HF's
        LabelSmoother when asked (dsx3d.integrations.label_smoothing)."""
        loss = self.mean_loss(outputs, labels)
        if not self.label_smoothing:
            return loss
        return smoothed(loss, whole_logits(outputs), labels, self.shard, self.label_smoothing)

    def _slice_loss(self, outputs: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """cp > 1: (targets, norm) of this CP rank's slice; the Trainer set norm so that the engine's loss, the
        slice's sum over norm, averages (over micro-batches and the dp x cp ranks) to HF's token-weighted mean
        in training, and to the micro-batch's sum of token losses in evaluation."""
        assert self.compute_loss_func is None, "refused at cp > 1 by dsx3d.Trainer"
        if self.training and self.stats is not None:
            self.stats.append(self.objective.step_statistics(whole_logits(outputs), labels[0], self.shard, pre_shifted=True))
        if not self.training and self.capture is not None:
            self.captured.append(self.capture(whole_logits(outputs), labels[0]))
        return self.mean_loss(outputs, labels)

    def _user_loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items: int) -> torch.Tensor:
        outputs = CausalLMOutputWithPast(logits=self.shard.full(logits))
        items = torch.tensor(num_items, device=logits.device)
        return self.compute_loss_func(outputs, labels, num_items_in_batch=items)  # type: ignore[misc]


def whole_logits(outputs: torch.Tensor | tuple[torch.Tensor, HeadInputs]) -> torch.Tensor:
    """The micro-batch's logits shard: `outputs` itself, or computed from a tiled head's hidden states."""
    if isinstance(outputs, tuple) and isinstance(outputs[1], HeadInputs):
        return outputs[1].logits()
    assert isinstance(outputs, torch.Tensor)
    return outputs


def capture_for(
    preprocess: Callable[[torch.Tensor, torch.Tensor], Captured] | None, shard: VocabShard, cp: CPContext | None = None
) -> Callable[[torch.Tensor, torch.Tensor], Captured]:
    """What evaluation keeps per micro-batch (on CPU): HF's `preprocess_logits_for_metrics(logits, labels)`, on
    full logits, except `argmax_logits`, which runs on the shards; without one, the full logits themselves.
    With cp > 1 (`cp`): the token predictions or the full logits, gathered over the CP group along the sequence."""
    cp = cp if cp is not None else CPContext()
    if preprocess is argmax_logits:
        return lambda logits, labels: cp.gather_sequence(shard.argmax(logits)).cpu()
    if cp.on:
        assert preprocess is None, "refused at cp > 1 by dsx3d.Trainer"
        return lambda logits, labels: cp.gather_sequence(shard.full(logits.detach())).cpu()

    def keep(logits: torch.Tensor, labels: torch.Tensor) -> Captured:
        full = shard.full(logits.detach())
        out = preprocess(full, labels) if preprocess is not None else full
        return _to_cpu(out)

    return keep


def _to_cpu(value: Captured) -> Captured:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple | list):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def context_parallel_refusals(
    cp: int, compute_loss_func: object, preprocess: Callable[[torch.Tensor, torch.Tensor], Captured] | None
) -> list[Problem]:
    """What dsx3d.Trainer cannot run at cp > 1: functions HF calls with whole sequences' logits and unshifted
    labels, where each CP rank holds a slice of positions and its shifted targets."""
    if cp == 1:
        return []
    problems = []
    if compute_loss_func is not None:
        problems.append(
            Problem(
                "Trainer(compute_loss_func=...)",
                getattr(compute_loss_func, "__name__", type(compute_loss_func).__name__),
                f"at parallel.cp = {cp} each rank's last stage holds a slice of every sequence, and a loss HF "
                "calls with whole sequences' logits and labels cannot be split into slices in general",
                "drop compute_loss_func (the default loss is HF's token mean), or set parallel.cp: 1",
            )
        )
    if preprocess is not None and preprocess is not argmax_logits:
        problems.append(
            Problem(
                "Trainer(preprocess_logits_for_metrics=...)",
                getattr(preprocess, "__name__", type(preprocess).__name__),
                f"at parallel.cp = {cp} it would get a slice of every sequence and shifted targets, not HF's labels",
                "use dsx3d.integrations.last_stage.argmax_logits (token predictions, gathered over the CP ranks), "
                "pass none (compute_metrics gets the full logits), or set parallel.cp: 1",
            )
        )
    return problems
