"""Supervised fine-tuning as TRL's SFTTrainer trains it: the language-modelling loss on the scored (completion or
assistant) tokens, and TRL's metrics: `mean_token_accuracy` and `entropy` per micro-batch, from the last stage's
vocab-parallel logits (argmax and softmax statistics reduced over the TP group, no full-logit gather), and
`num_tokens` counted from each batch as TRL counts it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dsx3d.distributed import comm
from dsx3d.objectives.base import IGNORE_INDEX, Objective


class SupervisedFineTuning(Objective):
    name = "sft"
    token_statistics = True

    def batch_tokens(self, batch: Mapping[str, object]) -> int:
        return batch_tokens(batch)

    def step_statistics(self, logits: torch.Tensor, labels: torch.Tensor, shard: Any, *, pre_shifted: bool = False) -> torch.Tensor:
        return token_statistics(logits, labels, shard, pre_shifted=pre_shifted)

    def record_step(self, trainer: Any, stats: list[torch.Tensor], micro_batches: int, tokens: int, contributes: bool) -> None:
        record_step(trainer, stats, micro_batches, tokens, contributes)


def token_statistics(logits: torch.Tensor, labels: torch.Tensor, shard: Any, *, pre_shifted: bool = False) -> torch.Tensor:
    """[scored tokens, correctly predicted ones, sum of their predictive entropies] of one micro-batch, from
    this rank's vocabulary shard of the logits (b, s, V/tp): TRL's mean_token_accuracy and entropy (token t+1
    predicted at t, only where it is scored). Reductions over the TP group are per token (three scalars a
    token), never the logits. `pre_shifted`: `labels` are already the targets of each position (a CP rank's slice,
    dsx3d.data.context_parallel); the sums of the CP slices are the micro-batch's."""
    target = labels if pre_shifted else torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    scored = target != IGNORE_INDEX
    z = logits.detach().float()[scored]  # (n, V/tp)
    n = int(scored.sum())
    if n == 0:
        return torch.zeros(3, dtype=torch.float64)
    predicted = shard.argmax(logits.detach())[scored]
    correct = int((predicted == target[scored]).sum())
    cols = torch.arange(shard.start, shard.start + z.shape[-1], device=z.device)
    z = z.masked_fill(cols >= shard.vocab, float("-inf"))
    top = z.max(dim=-1).values
    if shard.group is not None:
        top = comm.all_reduce_max(top.clone(), group=shard.group)
    shifted = z - top[:, None]
    e = shifted.exp()
    sums = torch.stack([e.sum(-1), (e * torch.nan_to_num(shifted, neginf=0.0)).sum(-1)])
    if shard.group is not None:
        sums = comm.all_reduce_sum(sums, group=shard.group)
    entropy = sums[0].log() - sums[1] / sums[0]
    return torch.tensor([n, correct, float(entropy.double().sum())], dtype=torch.float64)


def batch_tokens(batch: Mapping[str, object]) -> int:
    """The tokens of one collator batch as SFTTrainer counts them for `num_tokens`: the attention mask's ones,
    or with padding-free batches the flat row's length."""
    if "attention_mask" in batch:
        return int(torch.as_tensor(batch["attention_mask"]).sum())
    if "position_ids" in batch:
        return int(torch.as_tensor(batch["position_ids"]).shape[-1])
    return int(torch.as_tensor(batch["input_ids"]).numel())


def record_step(trainer: Any, stats: list[torch.Tensor], micro_batches: int, tokens: int, contributes: bool) -> None:
    """Add one optimizer step's figures to SFTTrainer's `_metrics["train"]` as its compute_loss would: per
    micro-batch slot, accuracy and entropy over the DP ranks' micro-batches of that slot; the running token
    count. `stats`: this rank's token_statistics per micro-batch (empty off the last stage); `contributes`:
    this rank adds them (one TP rank of each DP rank's last stage). A collective over every rank."""
    local = torch.zeros(micro_batches, 3, dtype=torch.float64)
    if contributes and stats:
        local = torch.stack(stats)
    total = comm.all_reduce_sum(local)
    metrics = trainer._metrics["train"]
    for valid, correct, entropy in total.tolist():
        metrics["entropy"].append(entropy / valid if valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
    trainer._total_train_tokens += tokens
    metrics["num_tokens"] = [trainer._total_train_tokens]
