"""HF's label smoothing (`TrainingArguments.label_smoothing_factor`, transformers' LabelSmoother) on vocab-sharded logits."""

from __future__ import annotations

from typing import Protocol

import torch

from dsx3d.distributed import comm
from dsx3d.distributed.comm import ProcessGroup
from dsx3d.distributed.tensor_parallel.mappings import reduce_from_tp

IGNORE_INDEX = -100


class Shard(Protocol):
    start: int
    vocab: int
    group: ProcessGroup | None


def uniform_token_sum(logits: torch.Tensor, labels: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The sum over scored positions of LabelSmoother's smoothed term, `sum_v -log softmax(z)_v` over the real
    vocabulary V, from this rank's columns (b, s, V/tp) with HF's causal shift (token t+1 scored at t).

    Per position it is V * logsumexp(z) - sum_v z_v: two sums over the TP group (exponentials and logits), the
    maximum taken for stability only. The sums go through `reduce_from_tp` (backward identity), so each rank's
    gradient is that of its own columns, as from the full-vocabulary loss."""
    z = logits[:, :-1].float()
    scored = labels[:, 1:] != IGNORE_INDEX
    z = z[scored]  # (n, V/tp)
    cols = torch.arange(shard.start, shard.start + z.shape[-1], device=z.device)
    real = cols < shard.vocab
    top = z.detach().masked_fill(~real, float("-inf")).max(dim=-1).values
    if shard.group is not None:
        top = comm.all_reduce_max(top.clone(), group=shard.group)
    exp_sum = reduce_from_tp(((z - top[:, None]).exp() * real).sum(-1), shard.group)
    logit_sum = reduce_from_tp((z * real).sum(-1), shard.group)
    lse = top + exp_sum.log()
    return (shard.vocab * lse - logit_sum).sum()


def smoothed(nll_mean: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, shard: Shard, epsilon: float) -> torch.Tensor:
    """LabelSmoother's loss over a micro-batch's n scored positions, as a mean over them: (1 - eps) * nll + eps *
    smoothed / (n * V). Weighted by n / N like the plain loss, it is HF's sum over the step's N items."""
    n = int((labels[:, 1:] != IGNORE_INDEX).sum())
    if epsilon == 0 or n == 0:
        return nll_mean
    return (1 - epsilon) * nll_mean + epsilon * uniform_token_sum(logits, labels, shard) / (n * shard.vocab)
