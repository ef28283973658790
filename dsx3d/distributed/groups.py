"""The process groups of a job without a pipeline, as the "mpu" object DeepSpeed's regular engine reads.

With a pipeline, DeepSpeed's `PipelineParallelGrid` builds the groups and serves as the engine's mpu. With
pp = 1 the regular engine (`deepspeed.initialize(model=nn.Module, mpu=...)`, which runs ZeRO-0/1/2/3) needs
one from us. It asks for the model-parallel group (gradient norms, overflow checks: here the TP group, since
there are no stages), the data-parallel group (gradient reduction, ZeRO partitioning, `zero.Init`) and,
where present, the `get_tensor_model_parallel_*` forms (deepspeed.utils.bwc prefers them).

Every rank must create every group, in the same order (torch.distributed.new_group is a collective over
the whole world, even for ranks outside the group).
"""

from __future__ import annotations

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def _own_group(groups: list[list[int]], rank: int) -> tuple[ProcessGroup, list[int]]:
    """Create every group of one axis (on every rank) and return the one holding `rank`, with its ranks."""
    mine: tuple[ProcessGroup, list[int]] | None = None
    for ranks in groups:
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = (group, list(ranks))
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the groups {groups}")
    return mine


class DataTensorParallelGroups:
    """DeepSpeed's mpu for dp x tp without a pipeline. `tp_groups` and `dp_groups` partition the world
    (dsx3d.plan.layout.Layout.tp_groups() / dp_groups(): TP ranks adjacent, as in DeepSpeed's topology)."""

    def __init__(self, tp_groups: list[list[int]], dp_groups: list[list[int]]):
        self.rank = dist.get_rank()
        self._tp_group, self._tp_ranks = _own_group(tp_groups, self.rank)
        self._dp_group, self._dp_ranks = _own_group(dp_groups, self.rank)

    # tensor (and, without stages, model) parallel: the TP group
    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self._tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self._tp_ranks.index(self.rank)

    def get_tensor_model_parallel_world_size(self) -> int:
        return len(self._tp_ranks)

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._tp_ranks[0]

    def get_model_parallel_group(self) -> ProcessGroup:
        return self._tp_group

    def get_model_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.get_tensor_model_parallel_world_size()

    # data parallel
    def get_data_parallel_group(self) -> ProcessGroup:
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return self._dp_ranks.index(self.rank)

    def get_data_parallel_world_size(self) -> int:
        return len(self._dp_ranks)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    # no pipeline
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
