"""The seam between a training objective and the engine and faces (`Objective`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

IGNORE_INDEX = -100
"""Labels at this value are not scored (HF's and TRL's convention)."""


class Objective:
    """Causal language modelling's defaults; a subclass changes what differs.

    - micro-batches: (input_ids, labels) with labels -100 where a token is not scored ((labels, norm) slices at
      cp > 1, packed inputs as (input_ids, position_ids)): `dsx3d.data.stream`, `dsx3d.integrations.batches`;
    - the last stage's loss: the token-weighted mean over the global batch of the vocab-parallel cross-entropy
      (`dsx3d.integrations.last_stage.LastStageLoss`, `dsx3d.models.pipe_layers`);
    - `token_statistics`: whether the last stage also keeps each micro-batch's token statistics for
      `record_step` (accuracy and entropy);
    - `reference`: what it needs of a reference model (None: nothing).
    """

    name: ClassVar[str] = "lm"
    token_statistics: ClassVar[bool] = False
    reference: ClassVar[str | None] = None

    def batch_tokens(self, batch: Mapping[str, object]) -> int:
        """The tokens of one collator batch that the objective's metrics count (0: none counted)."""
        return 0

    def step_statistics(self, logits: torch.Tensor, labels: torch.Tensor, shard: Any, *, pre_shifted: bool = False) -> torch.Tensor:
        """What the last stage keeps of one micro-batch for `record_step` (with `token_statistics`)."""
        raise NotImplementedError

    def record_step(self, trainer: Any, stats: list[torch.Tensor], micro_batches: int, tokens: int, contributes: bool) -> None:
        """Log one optimizer step's metrics on `trainer` (a collective over every rank where it logs any)."""
