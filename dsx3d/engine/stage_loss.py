"""The last stage's loss of `dsx3d train` for an objective that computes its own (`Objective.own_loss`, DPO): the
same `Objective.last_stage_loss` the Trainer face calls (dsx3d.integrations.last_stage), given the stage's vocabulary
shard, CP group and the flags the objective reads (training, reference_pass, stats)."""

from __future__ import annotations

from typing import Any

import torch

from dsx3d.distributed.context_parallel import CPContext
from dsx3d.engine.builder import Engine3D
from dsx3d.engine.vocab_shard import VocabShard
from dsx3d.objectives import Objective


class ObjectiveLoss:
    """Called as the pipeline's loss_fn(outputs, labels) on the last stage (or by the pp = 1 module)."""

    def __init__(self, objective: Objective, shard: VocabShard, cp: CPContext):
        self.objective, self.shard, self.cp = objective, shard, cp
        self.training = True
        self.reference_pass = False
        """The reference's forward-only pass: the loss returns per-sequence log-prob sums (dsx3d.engine.reference)."""
        self.stats: list[torch.Tensor] | None = None
        """When a list, training appends each micro-batch's statistics for the objective's metrics."""

    def __call__(self, outputs: Any, labels: Any) -> torch.Tensor:
        return self.objective.last_stage_loss(outputs, labels, self)


def install_objective_loss(engine: Engine3D, objective: Objective) -> ObjectiveLoss:
    """Put `objective`'s loss in the engine's place."""
    builder = engine.module.dsx3d_builder
    loss = ObjectiveLoss(objective, VocabShard(builder.vocab_start, builder.vocab, builder.tp.group), builder.cp)
    engine.module.loss_fn = loss
    return loss
