"""data.packing: whole chat or instruction examples laid back to back into rows of train.seq_len tokens.

The padded examples (dsx3d.data.sft, each already cut to seq_len) are grouped by best-fit decreasing
(dsx3d.models.packed.best_fit), so a row holds as many whole examples as fit and an example never spans two
rows. Each row carries position_ids that restart at 0 at every example, which keeps attention inside each
example on both engines: every example's logits are those it has alone. The tail of a row is padding: pad
tokens, labels -100, its own positions from 0 (no real token attends to it). The first token of every
example gets label -100: in a packed row the token before it belongs to another example, and alone it is
never a target either, so the tokens with loss, and the per-token normalisation over the global batch
(dsx3d.data.stream), are exactly those of the unpacked examples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsx3d.data.chat import IGNORE_INDEX
from dsx3d.errors import Problem
from dsx3d.models.packed import best_fit
from dsx3d.recipe.schema import DataSection


@dataclass(frozen=True)
class PackedExamples:
    input_ids: np.ndarray
    """(num_rows, seq_len) token ids."""
    labels: np.ndarray
    """(num_rows, seq_len) int32 labels, -100 on padding, prompts and each example's first token."""
    positions: np.ndarray
    """(num_rows, seq_len) int32 position_ids, restarting at 0 at every example and at the padding tail."""
    lengths: np.ndarray
    """(num_rows,) int32 tokens of examples in each row (the rest is padding)."""
    members: list[list[int]]
    """The indices of the examples in each row, in row order."""


def pack_examples(input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, pad_id: int) -> PackedExamples:
    """Best-fit pack the padded examples (rows of `input_ids` / `labels`, `lengths` real tokens each)."""
    num, seq_len = input_ids.shape
    sizes = [int(n) for n in lengths]
    if any(n > seq_len or n < 1 for n in sizes):
        raise ValueError(f"example lengths must lie in 1..{seq_len}")
    bins = best_fit(sizes, seq_len)
    ids_out = np.full((len(bins), seq_len), pad_id, dtype=input_ids.dtype)
    labels_out = np.full((len(bins), seq_len), IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros((len(bins), seq_len), dtype=np.int32)
    used = np.zeros(len(bins), dtype=np.int32)
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            n = sizes[i]
            ids_out[r, at : at + n] = input_ids[i, :n]
            labels_out[r, at : at + n] = labels[i, :n]
            labels_out[r, at] = IGNORE_INDEX
            positions[r, at : at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(seq_len - at)
        used[r] = at
    return PackedExamples(ids_out, labels_out, positions, used, bins)


def packing_problems(data: DataSection) -> list[Problem]:
    """data.packing where it does not apply: text data is always packed, into blocks that span documents."""
    if data.packing and not data.masked:
        return [
            Problem(
                "data.packing",
                True,
                "applies to chat and instruction data; data.format text already packs its documents into blocks "
                "of train.seq_len (loss on every token)",
                "remove data.packing, or set data.format to chat or instruction",
            )
        ]
    return []
