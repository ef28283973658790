"""Which columns of the vocabulary a last-stage rank's logits hold (`VocabShard`): what every objective's last-stage
loss and metrics read, for the Trainer's loss (dsx3d.integrations.last_stage) and the recipe's (dsx3d.engine.stage_loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsx3d.distributed import comm
from dsx3d.distributed.comm import ProcessGroup
from dsx3d.distributed.tensor_parallel.mappings import gather_last_dim


@dataclass
class VocabShard:
    """Which columns of the vocabulary this rank's logits hold, and the TP group that holds the rest."""

    start: int
    vocab: int
    """The real vocabulary size (columns past it are padding)."""
    group: ProcessGroup | None

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """(b, s, V/tp) -> (b, s, V): all-gathered over the TP group, padding columns dropped."""
        return gather_last_dim(logits, self.group)[..., : self.vocab]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """(b, s, V/tp) -> (b, s) global ids of the largest logit, the lowest id among ties (as torch.argmax):
        each rank's best value and column, the maximum value over ranks, then the lowest column holding it."""
        z = logits.detach().float()
        if self.group is None:  # one TP rank holds every column
            return z[..., : self.vocab].argmax(dim=-1)
        cols = torch.arange(self.start, self.start + z.shape[-1], device=z.device)
        z = z.masked_fill(cols >= self.vocab, float("-inf"))
        best, where = z.max(dim=-1)
        top = comm.all_reduce_max(best.clone(), group=self.group)
        ids = torch.where(best == top, where + self.start, torch.full_like(where, torch.iinfo(torch.int64).max))
        return -comm.all_reduce_max(-ids, group=self.group)  # the minimum over ranks
