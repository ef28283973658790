"""Data for the pipeline: HF batches (dicts from a collator) become fixed-shape (input_ids, labels) micro-batches,
sharded by data-parallel rank only, since TP and PP peers must read identical micro-batches. Padding-free
batches (position_ids marking documents) become packed ((input_ids, position_ids), labels) micro-batches
(dsx3d.integrations.padding_free).

The order matches a plain single-process `transformers.Trainer`: accelerate's seedable random sampler (seeded
by `data_seed`, else `seed`, plus the epoch), cut into micro-batches, micro-batch j going to DP rank j % dp
as accelerate's `BatchSamplerShard` does for DDP. So optimizer step t covers the same samples in any layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from dsx3d.errors import UserError
from dsx3d.integrations.padding_free import (
    PACKED_KEYS,
    empty_packed_micro_batch,
    is_padding_free,
    packed_micro_batch,
)

IGNORE_INDEX = -100
ACCEPTED_KEYS = frozenset({"input_ids", "labels", "attention_mask"})


def count_targets(labels: torch.Tensor) -> int:
    """Positions a causal LM is scored on: token t+1 is predicted at t, so labels[:, 1:] that are not ignored
    (what HF's Trainer counts as num_items_in_batch)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def to_micro_batch(
    batch: Mapping[str, object], micro_batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (micro_batch_size, seq_len): the batch right-padded with token 0 and label -100.

    The stages run no attention mask. Under causal attention that is exact for right padding: a real token never
    attends to a later position, so only the pads' own outputs change, and those are never scored as long as the
    labels after the first pad are ignored (`_check_right_padded`)."""
    if is_padding_free(batch):
        extra_keys = sorted(k for k in batch if k not in ACCEPTED_KEYS | PACKED_KEYS)
        if not extra_keys:
            return packed_micro_batch(batch, micro_batch_size, seq_len)  # type: ignore[return-value]
    extra = sorted(k for k in batch if k not in ACCEPTED_KEYS)
    if extra:
        raise UserError.single(
            "batch keys",
            extra,
            "the pipeline feeds the model input_ids and labels only (plus a right-padding attention_mask)",
            "drop these columns (TrainingArguments.remove_unused_columns=True does it for datasets.Dataset)",
        )
    if "labels" not in batch:
        raise UserError.single(
            "batch keys",
            sorted(batch),
            "the batch has no labels, so there is no loss to train on",
            "use DataCollatorForLanguageModeling(tokenizer, mlm=False) or add a labels column",
        )
    ids, labels = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["labels"])
    rows, length = ids.shape
    if length > seq_len:
        raise UserError.single(
            "sequence length",
            length,
            f"longer than the layout's seq_len = {seq_len} (every micro-batch has that shape)",
            "tokenize with truncation=True and max_length <= seq_len, or raise train.seq_len in the recipe and regenerate the config",
        )
    if "attention_mask" in batch:
        _check_right_padded(torch.as_tensor(batch["attention_mask"]), labels)
    if rows > micro_batch_size:
        raise RuntimeError(f"a batch of {rows} rows for micro-batches of {micro_batch_size}")
    out_ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
    out_labels = torch.full((micro_batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
    out_ids[:rows, :length] = ids
    out_labels[:rows, :length] = labels
    return out_ids, out_labels


def with_norm(micro: tuple[Any, torch.Tensor], norm: float) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) -> (inputs, (labels, norm)): the engine's loss is then the sum of the micro-batch's token
    losses divided by norm (the form context parallelism slices, dsx3d.data.context_parallel)."""
    inputs, labels = micro
    return inputs, (labels, torch.tensor([norm], dtype=torch.float64))


def empty_micro_batch(micro_batch_size: int, seq_len: int, packed: bool = False) -> tuple[Any, torch.Tensor]:
    """A micro-batch that scores nothing: evaluation pads the ranks that run out of data with it (`packed`: in
    the shape of padding-free micro-batches, dsx3d.integrations.padding_free)."""
    if packed:
        return empty_packed_micro_batch(micro_batch_size, seq_len)
    return torch.zeros(micro_batch_size, seq_len, dtype=torch.long), torch.full(
        (micro_batch_size, seq_len), IGNORE_INDEX
    )


def _check_right_padded(mask: torch.Tensor, labels: torch.Tensor) -> None:
    padded = (mask == 0).long().cumsum(dim=1) > 0  # (b, s): at or after the first pad
    if bool((mask[padded] != 0).any()):
        raise UserError.single(
            "attention_mask",
            "left or inner padding",
            "the pipeline runs without an attention mask, which is exact only for right padding",
            "pad on the right (tokenizer.padding_side = 'right') and do not pack several documents with a mask",
        )
    if bool((labels[:, 1:][padded[:, :-1]] != IGNORE_INDEX).any()):
        raise UserError.single(
            "labels",
            "scored positions after the padding starts",
            "a pad's output differs without the attention mask, so labels past the first pad must be -100",
            "set labels to -100 on padding (DataCollatorForLanguageModeling does)",
        )


class DataParallelBatchSampler(Sampler[list[int]]):
    """Micro-batches of `sampler`'s indices for one DP rank: micro-batch j goes to rank j % dp.

    Training (`step_micro_batches` given) keeps whole optimizer steps only: each rank gets a multiple of that
    many full micro-batches per epoch and the remainder is dropped, since every pipeline step takes exactly
    gradient_accumulation_steps micro-batches of one shape. Evaluation keeps every sample: the last micro-batch
    may be short, and the last ranks may get one fewer."""

    def __init__(
        self,
        sampler: Sampler[int],
        micro_batch_size: int,
        dp: int,
        dp_rank: int,
        step_micro_batches: int | None = None,
        drop_last: bool = False,
    ):
        self.sampler, self.micro_batch_size, self.dp, self.dp_rank = sampler, micro_batch_size, dp, dp_rank
        self.step_micro_batches = step_micro_batches
        num_samples = len(sampler) if isinstance(sampler, Sized) else 0
        if step_micro_batches is None:
            self.num_micro_batches = (num_samples // micro_batch_size) if drop_last else math.ceil(num_samples / micro_batch_size)
            self.length = len(range(dp_rank, self.num_micro_batches, dp))
        else:
            steps = num_samples // micro_batch_size // (dp * step_micro_batches)
            self.num_micro_batches = steps * step_micro_batches * dp
            self.length = steps * step_micro_batches
        self.num_samples = (
            self.num_micro_batches * micro_batch_size if step_micro_batches is not None else num_samples
        )

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[list[int]]:
        train = self.step_micro_batches is not None
        for j, batch in enumerate(BatchSampler(self.sampler, self.micro_batch_size, drop_last=train)):
            if j >= self.num_micro_batches:
                break
            if j % self.dp == self.dp_rank:
                yield batch

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


class ShardedDataLoader(DataLoader):
    """A DataLoader over a `DataParallelBatchSampler`; `num_samples` counts what all DP ranks read per epoch."""

    batch_sampler: DataParallelBatchSampler

    @property
    def num_samples(self) -> int:
        return self.batch_sampler.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
