"""The Trainer's data loaders: micro-batches sharded by DP rank only (TP and PP peers read the same ones), and the counts HF reports over every DP shard once."""

from __future__ import annotations

import logging
from typing import Any

import torch
from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, SequentialSampler

from dsx3d.boundary_types import Batch, HFTrainingArguments
from dsx3d.errors import UserError
from dsx3d.integrations.batches import (
    DataParallelBatchSampler,
    ShardedDataLoader,
)
from dsx3d.integrations.train_batches import TrainBatchSampler
from dsx3d.integrations.trainer_base import EngineTrainerBase

log = logging.getLogger("dsx3d")


class DataLoadersMixin(EngineTrainerBase):
    """The Trainer's train, eval and test loaders and the example counts built on them."""

    def get_train_dataloader(self) -> ShardedDataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._sharded_loader(self.train_dataset, "Training", train=True)

    def get_eval_dataloader(self, eval_dataset: str | Dataset[Batch] | None = None) -> ShardedDataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]  # type: ignore[index]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._sharded_loader(dataset, "Evaluation", train=False)

    def get_test_dataloader(self, test_dataset: Dataset[Batch]) -> ShardedDataLoader:
        return self._sharded_loader(test_dataset, "test", train=False)

    def _sharded_loader(self, dataset: Any, description: str, train: bool) -> ShardedDataLoader:
        import datasets

        if isinstance(dataset, IterableDataset | datasets.IterableDataset):
            raise UserError.single(
                f"{description} dataset",
                type(dataset).__name__,
                "dsx3d.Trainer shards data by index and needs a dataset with a length",
                "pass a map-style dataset (datasets.Dataset or a torch Dataset with __len__)",
            )
        collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        train_cfg, args, place = self._dsx3d.recipe.train, self.args, self._dsx3d.placement
        if train and args.train_sampling_strategy == "random":
            seed = args.data_seed if args.data_seed is not None else args.seed
            sampler: Sampler[int] = SeedableRandomSampler(
                dataset, data_seed=seed
            )  # what accelerate gives HF's Trainer
        else:
            sampler = SequentialSampler(dataset)
        if train:  # HF's batches: the last one short unless dataloader_drop_last, the epoch's last step short
            batches: DataParallelBatchSampler = TrainBatchSampler(
                sampler, train_cfg.micro_batch_size, self.layout.dp, place.dp, args.dataloader_drop_last
            )
        else:
            batches = DataParallelBatchSampler(
                sampler, args.per_device_eval_batch_size, self.layout.dp, place.dp, drop_last=args.dataloader_drop_last
            )
        workers = args.dataloader_num_workers
        return ShardedDataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=args.dataloader_persistent_workers if workers else False,
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
        )

    def num_examples(self, dataloader: DataLoader[Batch]) -> int:
        if isinstance(dataloader, ShardedDataLoader):
            return dataloader.num_samples
        return super().num_examples(dataloader)

    def get_total_train_batch_size(self, args: HFTrainingArguments) -> int:
        """micro-batch x accumulation x dp: TP and PP ranks share their DP rank's samples."""
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.layout.dp
