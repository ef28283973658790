"""TRL's SFTTrainer as a face of dsx3d.Trainer: `class PipelinedSFT(dsx3d.Trainer, trl.SFTTrainer)`.

dsx3d.Trainer comes first, so its data loaders, optimizer, training step and evaluation loop are the ones that
run; SFTTrainer still prepares the dataset (tokenizing, chat templates, completion/assistant masks, packing),
picks the collator (padding-free with packing=True) and logs. dsx3d's step never calls SFTTrainer.compute_loss,
so what that method would add is either computed here or refused:

- the metrics it logs: `mean_token_accuracy` and `entropy` per micro-batch, from the last stage's
  vocab-parallel logits (argmax and softmax statistics reduced over the TP group, no full-logit gather), and
  `num_tokens` counted from each batch as TRL counts it;
- SFTConfig options that change the loss inside compute_loss (`loss_type` other than "nll",
  `activation_offloading`, which wraps SFTTrainer's own training step) are refused by name.
Other TRL trainers (DPO, GRPO, KTO, reward, RLOO, distillation) compute their losses in ways dsx3d's last
stage does not: they are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dsx3d.distributed import comm
from dsx3d.errors import Problem

IGNORE_INDEX = -100


def _trl_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"]


def sft_trainer_class(cls: type) -> type | None:
    """TRL's SFTTrainer among `cls`'s bases, or None."""
    return next((c for c in _trl_classes(cls) if c.__name__ == "SFTTrainer"), None)


def refusals(cls: type, args: object) -> list[Problem]:
    """What dsx3d.Trainer cannot honour in a class combining it with a TRL trainer, and in its SFTConfig."""
    trl_bases = _trl_classes(cls)
    if not trl_bases:
        return []
    sft = sft_trainer_class(cls)
    allowed = set(sft.__mro__) if sft is not None else set()
    others = [c.__name__ for c in trl_bases if c not in allowed]
    if others:
        return [
            Problem(
                f"base class {others[0]}",
                f"{others[0]} ({cls.__name__}'s bases)",
                "dsx3d.Trainer supports TRL's SFTTrainer only: other TRL trainers compute their losses (preference pairs, "
                "rewards, generations) in compute_loss, which dsx3d's pipeline step does not run",
                "combine dsx3d.Trainer with trl.SFTTrainer, or train this stage with TRL alone",
            )
        ]
    problems = []
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type != "nll":
        problems.append(
            Problem(
                "SFTConfig.loss_type",
                loss_type,
                "dsx3d's last stage computes the token-mean cross-entropy (nll) on vocabulary shards; "
                "SFTTrainer.compute_loss, where the other loss types live, is not run",
                'set loss_type="nll" (dsx3d never materialises the full logits, so chunking buys nothing)',
            )
        )
    if getattr(args, "activation_offloading", False):
        problems.append(
            Problem(
                "SFTConfig.activation_offloading",
                True,
                "it wraps SFTTrainer's training step, which dsx3d's replaces",
                "set it to False (train.activation_checkpointing in the recipe saves activation memory)",
            )
        )
    return problems


def token_statistics(logits: torch.Tensor, labels: torch.Tensor, shard: Any, *, pre_shifted: bool = False) -> torch.Tensor:
    """[scored tokens, correctly predicted ones, sum of their predictive entropies] of one micro-batch, from
    this rank's vocabulary shard of the logits (b, s, V/tp): TRL's mean_token_accuracy and entropy (token t+1
    predicted at t, only where it is scored). Reductions over the TP group are per token (three scalars a
    token), never the logits. `pre_shifted`: `labels` are already the targets of each position (a CP rank's slice,
    dsx3d.data.cp_slice); the sums of the CP slices are the micro-batch's."""
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
