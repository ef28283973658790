"""Training batches and steps as transformers.Trainer 5.23 makes them: partial last batch and short last step kept."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, Sampler

from dsx3d.integrations.batches import DataParallelBatchSampler, empty_micro_batch


class TrainBatchSampler(DataParallelBatchSampler):
    """One DP rank's training micro-batches, the batches transformers.Trainer's loader yields on that rank.

    The sampler is cut into micro-batches, the last one short unless `drop_last` (`dataloader_drop_last`). At
    dp = 1 that is all (accelerate leaves a one-process loader alone). At dp > 1 micro-batch j goes to DP rank
    j % dp through accelerate's own `BatchSamplerShard` (even_batches, its default): every rank gets the same
    number of micro-batches, the round the data does not fill completed with the epoch's first samples, as
    under HF's DDP. The epoch's last optimizer step may take fewer micro-batches than gradient_accumulation_steps
    (transformers' update steps per epoch: len // GA + int(len % GA > 0)); `pad_step` fills it for the pipeline."""

    def __init__(self, sampler: Sampler[int], micro_batch_size: int, dp: int, dp_rank: int, drop_last: bool):
        self.sampler, self.micro_batch_size, self.dp, self.dp_rank = sampler, micro_batch_size, dp, dp_rank
        self.step_micro_batches = None
        batches: Any = BatchSampler(sampler, micro_batch_size, drop_last=drop_last)
        self.batches: Any = batches if dp == 1 else BatchSamplerShard(batches, num_processes=dp, process_index=dp_rank)
        self.length = len(self.batches)
        self.num_micro_batches = self.length * dp
        self.num_samples = len(sampler) if isinstance(sampler, Sized) else 0  # HF's num_examples: the dataset's length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches


def pad_step(micro: list[Any], step_micro_batches: int, rows: int, seq_len: int) -> list[Any]:
    """A short optimizer step (the epoch's last, fewer micro-batches than the pipeline takes) filled with
    micro-batches that score nothing: each contributes a zero loss and a zero gradient, since the loss weights
    every micro-batch by its scored tokens over the step's (dsx3d.integrations.last_stage.LastStageLoss)."""
    if not micro or len(micro) >= step_micro_batches:
        return micro
    packed = not isinstance(micro[0][0], torch.Tensor)  # padding-free: ((input_ids, position_ids), labels)
    return micro + [empty_micro_batch(rows, seq_len, packed) for _ in range(step_micro_batches - len(micro))]
