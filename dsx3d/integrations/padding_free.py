"""Padding-free batches for the pipeline: what `transformers.DataCollatorWithFlattening` and TRL's
`padding_free=True` / `packing=True` collators make, as fixed-shape packed micro-batches.

Such a batch marks documents by position_ids restarting at 0 (usually one flat row holding every example of
the batch), the labels of each document's first token -100, and may add `cu_seq_lens_q/k`, `max_length_q/k`
and `seq_idx`, which say the same as position_ids for varlen kernels; dsx3d reads position_ids and drops
those. The documents are laid back to back, in order and whole, into micro_batch_size rows of seq_len
(next-fit, which for an order-preserving split needs the fewest rows: a batch of b examples of at most
seq_len tokens always fits b rows), each row's tail padded as a document of its own. Documents without a
scored token (pads) are dropped: nothing attends to them. Attention stays inside each document
(dsx3d.models.packed), so every scored token's loss is the one the plain model computes on the flat row.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsx3d.errors import UserError
from dsx3d.models.packed import document_lengths, document_positions

IGNORE_INDEX = -100
VARLEN_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
"""Keys a padding-free collator adds for varlen kernels; they repeat what position_ids say."""
PACKED_KEYS = frozenset({"position_ids"}) | VARLEN_KEYS


def is_padding_free(batch: Mapping[str, object]) -> bool:
    return any(k in batch for k in PACKED_KEYS)


def packed_micro_batch(
    batch: Mapping[str, object], micro_batch_size: int, seq_len: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((input_ids, position_ids), labels), each (micro_batch_size, seq_len), from a padding-free batch."""
    if "position_ids" not in batch:
        raise UserError.single(
            "batch keys",
            sorted(k for k in batch if k in VARLEN_KEYS),
            "dsx3d finds the documents of a padding-free batch from its position_ids, which it lacks",
            "use a collator that returns position_ids (DataCollatorWithFlattening, TRL's padding_free=True)",
        )
    ids = torch.as_tensor(batch["input_ids"])
    labels = torch.as_tensor(batch["labels"])
    positions = torch.as_tensor(batch["position_ids"]).expand_as(ids)
    keep = torch.as_tensor(batch["attention_mask"]).bool() if "attention_mask" in batch else torch.ones_like(ids, dtype=torch.bool)
    documents: list[tuple[torch.Tensor, torch.Tensor]] = []
    for r in range(ids.shape[0]):
        at = 0
        for n in document_lengths(positions[r]):
            doc_ids, doc_labels = ids[r, at : at + n], labels[r, at : at + n]
            if at > 0 and int(doc_labels[0]) != IGNORE_INDEX:
                raise UserError.single(
                    "labels",
                    f"the first token of a document at position {at} of row {r} is scored",
                    "the plain model would predict it from the previous document, which packed rows cannot repeat",
                    "set labels to -100 at every position_ids == 0 (DataCollatorWithFlattening and TRL's collator do)",
                )
            if bool(keep[r, at : at + n].all()) and bool((doc_labels[1:] != IGNORE_INDEX).any()):
                doc_labels = doc_labels.clone()
                doc_labels[0] = IGNORE_INDEX  # never a target alone; in a new row it would follow another document
                documents.append((doc_ids, doc_labels))
            at += n
    longest = max((len(d) for d, _ in documents), default=0)
    if longest > seq_len:
        raise UserError.single(
            "sequence length",
            longest,
            f"a document is longer than the layout's seq_len = {seq_len} (every micro-batch row has that shape)",
            "set max_length <= seq_len in the collator or SFTConfig, or raise train.seq_len in the recipe",
        )
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    room = seq_len
    for doc in documents:
        if len(doc[0]) > room:
            rows.append([])
            room = seq_len
        rows[-1].append(doc)
        room -= len(doc[0])
    if len(rows) > micro_batch_size:
        raise UserError.single(
            "padding-free batch",
            f"{sum(len(d) for d, _ in documents)} tokens in {len(documents)} documents",
            f"they need {len(rows)} rows of seq_len = {seq_len}, a micro-batch has {micro_batch_size}",
            "lower max_length (or the packing length) to at most seq_len, or raise train.seq_len",
        )
    out_ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
    out_labels = torch.full((micro_batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
    out_positions = torch.stack([torch.arange(seq_len)] * micro_batch_size)
    for r, docs in enumerate(rows):
        at = 0
        for doc_ids, doc_labels in docs:
            out_ids[r, at : at + len(doc_ids)] = doc_ids
            out_labels[r, at : at + len(doc_ids)] = doc_labels
            at += len(doc_ids)
        out_positions[r] = document_positions([len(d) for d, _ in docs], seq_len)
    return (out_ids, out_positions), out_labels


def empty_packed_micro_batch(micro_batch_size: int, seq_len: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A packed micro-batch that scores nothing (the shape evaluation pads with in a padding-free run)."""
    positions = torch.stack([torch.arange(seq_len)] * micro_batch_size)
    ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
    return (ids, positions), torch.full((micro_batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
