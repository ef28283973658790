"""Preference batches as TRL's `DataCollatorForPreference` makes them (input_ids of P chosen then P rejected rows,
attention_mask, completion_mask, optionally precomputed ref_chosen_logps / ref_rejected_logps) -> the fixed-shape
DPO micro-batch of `dsx3d.objectives.dpo` (pairs padded to the micro-batch's, each half in its place)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dsx3d.errors import UserError
from dsx3d.objectives.base import IGNORE_INDEX

PREFERENCE_KEYS = frozenset({"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"})


def preference_micro_batch(batch: Mapping[str, object], pairs: int, seq_len: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(input_ids (2 * pairs, seq_len), (labels, norm, ref, tokens)): labels are the completions' tokens (-100 on
    prompts and padding, as TRL masks them), ref the precomputed reference sums or NaN, tokens each completion's
    length (TRL's completion_mask.sum(1)), -1 on padding pairs."""
    extra = sorted(k for k in batch if k not in PREFERENCE_KEYS)
    if extra or "completion_mask" not in batch:
        raise UserError.single(
            "batch keys",
            extra or sorted(batch),
            "a DPO micro-batch is built from TRL's preference collator output (input_ids, attention_mask, "
            "completion_mask, optionally ref_chosen_logps / ref_rejected_logps)",
            "use trl.DPOTrainer's default collator (DataCollatorForPreference), or drop these columns",
        )
    ids = torch.as_tensor(batch["input_ids"])
    completion = torch.as_tensor(batch["completion_mask"])
    rows, length = ids.shape
    if length > seq_len:
        raise UserError.single(
            "sequence length",
            length,
            f"prompt + completion is longer than the layout's seq_len = {seq_len} (every micro-batch has that shape)",
            "set DPOConfig.max_length <= seq_len (or data.max_length), or raise train.seq_len in the recipe",
        )
    given = rows // 2
    if rows % 2 or given > pairs:
        raise RuntimeError(f"a preference batch of {rows} rows for micro-batches of {pairs} pairs")
    mask = batch.get("attention_mask")
    if mask is not None:
        padded = (torch.as_tensor(mask) == 0).long().cumsum(dim=1) > 0
        if bool((torch.as_tensor(mask)[padded] != 0).any()):
            raise UserError.single(
                "attention_mask", "left or inner padding", "the pipeline runs without an attention mask, exact only for right padding",
                "pad on the right (DataCollatorForPreference does)",
            )  # fmt: skip
    labels = ids.masked_fill(completion == 0, IGNORE_INDEX)
    out_ids = torch.zeros(2 * pairs, seq_len, dtype=torch.long)
    out_labels = torch.full((2 * pairs, seq_len), IGNORE_INDEX, dtype=torch.long)
    tokens = torch.full((2 * pairs,), -1.0, dtype=torch.float64)
    ref = torch.full((2 * pairs,), float("nan"), dtype=torch.float64)
    for half in (0, 1):
        src, dst = slice(half * given, (half + 1) * given), slice(half * pairs, half * pairs + given)
        out_ids[dst, :length] = ids[src]
        out_labels[dst, :length] = labels[src]
        tokens[dst] = completion[src].sum(dim=1).to(torch.float64)
    if "ref_chosen_logps" in batch and "ref_rejected_logps" in batch:
        ref[:given] = torch.as_tensor(batch["ref_chosen_logps"], dtype=torch.float64)
        ref[pairs : pairs + given] = torch.as_tensor(batch["ref_rejected_logps"], dtype=torch.float64)
    return out_ids, (out_labels, torch.ones(1, dtype=torch.float64), ref, tokens)


def empty_preference_micro_batch(pairs: int, seq_len: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A micro-batch of padding pairs only (evaluation pads ranks that run out of data with it)."""
    batch = {
        "input_ids": torch.zeros(0, 1, dtype=torch.long),
        "completion_mask": torch.zeros(0, 1, dtype=torch.long),
    }
    return preference_micro_batch(batch, pairs, seq_len)


def has_reference(micro: tuple[Any, Any]) -> bool:
    """Whether the micro-batch's real pairs carry reference sums already (precomputed)."""
    _, (_, _, ref, tokens) = micro
    return bool(torch.isfinite(ref[tokens >= 0]).all())
