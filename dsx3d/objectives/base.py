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
    - `reference`: what it needs of a reference model (None: nothing; "log_probs": the reference's per-sequence
      log-prob sums of each micro-batch, from a forward-only pass on the same pipeline, `dsx3d.engine.reference`);
    - `own_loss`: the last stage calls `last_stage_loss` instead of the language-modelling loss, and the faces
      build micro-batches with `micro_batch` (DPO: `dsx3d.objectives.dpo`).
    """

    name: ClassVar[str] = "lm"
    token_statistics: ClassVar[bool] = False
    reference: ClassVar[str | None] = None
    own_loss: ClassVar[bool] = False

    def batch_tokens(self, batch: Mapping[str, object]) -> int:
        """The tokens of one collator batch that the objective's metrics count (0: none counted)."""
        return 0

    def step_statistics(self, logits: torch.Tensor, labels: torch.Tensor, shard: Any, *, pre_shifted: bool = False) -> torch.Tensor:
        """What the last stage keeps of one micro-batch for `record_step` (with `token_statistics`)."""
        raise NotImplementedError

    def record_step(self, trainer: Any, stats: list[torch.Tensor], micro_batches: int, tokens: int, contributes: bool) -> None:
        """Log one optimizer step's metrics on `trainer` (a collective over every rank where it logs any)."""

    def micro_batch(self, batch: Mapping[str, object], rows: int, seq_len: int) -> tuple[Any, Any] | None:
        """One collator batch as a fixed-shape micro-batch of `rows` examples (None: the face's own conversion)."""
        return None

    def scored_tokens(self, labels: Any) -> int:
        """The positions a micro-batch's labels score (token t+1 predicted at t)."""
        return int((labels[:, 1:] != IGNORE_INDEX).sum())

    def last_stage_loss(self, outputs: Any, labels: Any, stage: Any) -> torch.Tensor:
        """With `own_loss`: what the pipeline's loss function returns for one micro-batch."""
        raise NotImplementedError
