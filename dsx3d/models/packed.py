"""Packed rows: several documents in one row of a micro-batch, marked by position_ids restarting at 0.

This is how transformers marks them (`DataCollatorWithFlattening`, TRL's padding-free collator): a row whose
position_ids read 0 1 2 0 1 0 1 2 3 holds three documents, and HF's mask utilities
(`masking_utils.find_packed_sequence_indices`) then build a causal mask per document, for every attention
implementation that takes a mask (eager, sdpa), while the rotary tables follow each document's own positions.
So each document's logits are those of the document alone.

What travels between pipeline stages is a tuple (hidden_states, input_ids[, position_ids][, router_logits]):
position_ids is an integer tensor (only float tensors get gradients between stages), the same whole-sequence
tensor on every TP rank, so masks built on any stage, with or without sequence parallelism, keep the
document boundaries. The first stage receives either input_ids or (input_ids, position_ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Carried = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def split_inputs(inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first stage's input: input_ids, or (input_ids, position_ids) for packed rows."""
    if isinstance(inputs, torch.Tensor):
        return inputs, None
    ids, *rest = inputs
    return ids, (rest[0] if rest else None)


def unpack(inputs: Sequence[torch.Tensor]) -> Carried:
    """(hidden, input_ids, position_ids or None, router_logits or None) from a stage's input tuple: of the
    optional tensors, the integer one is position_ids and the float one the router logits."""
    hidden, ids, *rest = inputs
    positions = next((t for t in rest if not t.is_floating_point()), None)
    router = next((t for t in rest if t.is_floating_point()), None)
    return hidden, ids, positions, router


def pack(hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor | None, router: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The tuple `unpack` reads."""
    return (hidden, ids, *(t for t in (positions, router) if t is not None))


def document_positions(lengths: Sequence[int], row_length: int) -> torch.Tensor:
    """position_ids of one row holding documents of `lengths` back to back, then a tail of padding that counts
    from 0 as a document of its own (never scored, and no real token attends to it)."""
    parts = [torch.arange(n) for n in lengths]
    tail = row_length - sum(lengths)
    if tail < 0:
        raise ValueError(f"documents of {sum(lengths)} tokens do not fit a row of {row_length}")
    if tail:
        parts.append(torch.arange(tail))
    return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)


def document_lengths(positions: torch.Tensor) -> list[int]:
    """The lengths of the documents of one row of position_ids (a new document wherever a position is not
    the previous one plus 1, as HF's `find_packed_sequence_indices` decides)."""
    p = positions.reshape(-1).tolist()
    lengths: list[int] = []
    for i, value in enumerate(p):
        if i == 0 or value != p[i - 1] + 1:
            lengths.append(1)
        else:
            lengths[-1] += 1
    return lengths


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: indices of whole items grouped into bins of `capacity` tokens (an item longer
    than capacity gets a bin of its own; the caller cuts or refuses it). Deterministic: ties keep the lower
    index first, bins keep their items in index order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        best = -1
        for b, room in enumerate(free):
            if n <= room and (best < 0 or room < free[best]):
                best = b
        if best < 0:
            bins.append([i])
            free.append(capacity - n)
        else:
            bins[best].append(i)
            free[best] -= n
    return [sorted(b) for b in bins]
