"""A micro-batch cut to one CP rank's slice of every sequence (context parallelism).

CP rank r of cp keeps positions [r*s/cp, (r+1)*s/cp) of every row: its input ids and position ids (packed
rows keep their restarting positions; plain rows get 0 .. s-1, which attention needs after the exchange) and
its targets. Targets are shifted before the cut (the target at position t is the token at t+1, -100 at the
end of the row), so the last position of a slice is scored against the first token of the next slice.

The loss then always comes in the (targets, norm) form: the sum of this rank's token losses divided by norm.
DeepSpeed averages over micro-batches and its data ranks, which are dp x cp; dividing each rank's norm by cp
makes that average the per-token mean over every CP slice, exactly the unsliced loss: for masked rows the
stream's global normaliser (dsx3d.data.stream), for plain labels the micro-batch's own count of tokens with
loss (HF's mean per micro-batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

IGNORE_INDEX = -100

def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM targets: labels moved left by one, -100 after the last position."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def slice_micro_batch(micro: tuple[Any, Any], cp: int, cp_rank: int) -> tuple[Any, Any]:
    """(input_ids | (input_ids, position_ids), labels | (labels, norm, *per_row)) -> this CP rank's
    ((ids, position_ids), (shifted targets, norm / cp, *per_row)), every (b, s) tensor cut to its positions."""
    inputs, labels = micro
    if isinstance(inputs, torch.Tensor):
        ids, positions = inputs, None
    else:
        ids, positions = inputs[0], (inputs[1] if len(inputs) > 1 else None)
    b, s = ids.shape
    if s % cp:
        raise ValueError(f"sequence length {s} is not divisible by cp = {cp}")
    if positions is None:
        positions = torch.arange(s, dtype=torch.long).expand(b, s).contiguous()
    labels, norm, *rest = labels if isinstance(labels, (tuple, list)) else (labels, None)
    targets = shifted_targets(labels)
    if norm is None:
        norm = (targets != IGNORE_INDEX).sum().clamp(min=1).to(torch.float64).reshape(1)
    part = s // cp
    rows = slice(cp_rank * part, (cp_rank + 1) * part)
    cut_norm = norm.to(torch.float64).reshape(1) / cp
    cut = (targets[:, rows].contiguous(), cut_norm, *rest)  # rest: per-row values (DPO's), kept whole
    return (ids[:, rows].contiguous(), positions[:, rows].contiguous()), cut


def sliced(micro_batches: Iterator[tuple[Any, Any]], cp: int, cp_rank: int) -> Iterator[tuple[Any, Any]]:
    """`slice_micro_batch` on every micro-batch of an iterator (cp = 1: unchanged)."""
    if cp == 1:
        yield from micro_batches
        return
    for micro in micro_batches:
        yield slice_micro_batch(micro, cp, cp_rank)
