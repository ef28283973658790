"""The recipe's `train.dpo` section: what `train.objective: dpo` trains with (dsx3d.objectives.dpo).

Only the shapes are checked here (the recipe stays pure: no torch); which loss types are computed, and which
reference fits the model, is the checker's (`dsx3d.checks.dpo`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator

REFERENCES = ("auto", "copy", "adapters_off", "precomputed")


class DPOSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    beta: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1000)] = 0.1
    """How far the policy may move from the reference (TRL's beta): the rewards are beta x the log-ratios."""
    loss_type: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=8)] = Field(
        default_factory=lambda: ["sigmoid"]
    )
    """TRL's loss type (a name or a list, summed with loss_weights): sigmoid, hinge, ipo, robust, ..."""
    loss_weights: Annotated[list[StrictFloat | StrictInt], Field(min_length=1, max_length=8)] | None = None
    """One weight per loss type (default 1 each)."""
    label_smoothing: Annotated[StrictFloat, Field(ge=0, lt=0.5)] = 0.0
    """The probability that a pair's labels are flipped (cDPO, robust)."""
    reference: Literal["auto", "copy", "adapters_off", "precomputed"] = "auto"
    """Which weights give the reference's log-probs. copy: a frozen copy of the initial trainable weights (one more
    copy of them in memory, one forward pass a step); adapters_off: a LoRA model's base (model.lora with fresh
    adapters; no memory); precomputed: the data's ref_chosen_logps / ref_rejected_logps columns (no pass); auto:
    precomputed when the data has those columns, adapters_off under model.lora with fresh adapters, else copy."""

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value
