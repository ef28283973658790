"""The expert-parallel process groups of a layout, and what DeepSpeed needs to know about them.

`create_expert_groups` builds, on every rank and in the same order, one group per EP group and one per
expert-data-parallel (EDP) group of the layout (`dsx3d.plan.layout.Layout.ep_groups` / `edp_groups`, equal to the
groups DeepSpeed's own `groups._get_expert_parallel_ranks` computes) and returns this rank's two.

DeepSpeed's ZeRO (stage 1/2) and its BF16 optimizer reduce the gradients of parameters marked
`allreduce = False` over the expert-data-parallel group named by their `group_name`, and partition their
optimizer state over it, but only for an engine that has found MoE layers, and they look the groups up in
DeepSpeed's own registry (`deepspeed.utils.groups`). So `register_with_deepspeed` enters this rank's groups
there under DeepSpeed's naming ("ep_size_<ep>"), and `MoEMarker` is the module whose presence makes the
engine configure its optimizer for experts. The engine's MoE checkpoint format (one file per expert of a
`deepspeed.moe.layer.MoE`) does not apply to pipeline stages: `keep_pipeline_checkpoints` makes DeepSpeed
save and load them as the pipeline's own layer files (`dsx3d.pipeline.module` names the expert shards).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NoReturn

from torch import nn

from dsx3d.boundary_types import PipeEngine
from dsx3d.distributed import comm
from dsx3d.distributed.comm import ProcessGroup


@dataclass
class ExpertGroups:
    ep_group: ProcessGroup
    ep_ranks: list[int]
    edp_group: ProcessGroup
    edp_ranks: list[int]

    @property
    def name(self) -> str:
        """DeepSpeed's name for expert groups of this size (it parses the size back out of it)."""
        return f"ep_size_{len(self.ep_ranks)}"


def create_expert_groups(ep_groups: list[list[int]], edp_groups: list[list[int]], rank: int) -> ExpertGroups:
    """Every rank calls this with the layout's groups (a collective: each new group involves all ranks)."""
    mine: dict[str, Any] = {}
    for kind, groups in (("ep", ep_groups), ("edp", edp_groups)):
        for ranks in groups:
            group = comm.new_group(ranks)
            if rank in ranks:
                mine[kind] = (group, list(ranks))
    return ExpertGroups(*mine["ep"], *mine["edp"])


def register_with_deepspeed(groups: ExpertGroups) -> None:
    """Enter this rank's groups in DeepSpeed's registry, where its optimizers look them up by name."""
    from deepspeed.utils import groups as ds_groups

    ds_groups._EXPERT_PARALLEL_GROUP[groups.name] = groups.ep_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[groups.name] = groups.ep_ranks
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[groups.name] = groups.edp_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[groups.name] = groups.edp_ranks


def moe_marker(num_experts: int) -> nn.Module:
    """A parameter-free module that DeepSpeed's engine recognises as an MoE layer (`isinstance(m, MoE)`),
    so that it builds its optimizer with expert parameter groups; its groups are already registered."""
    from deepspeed.moe.layer import MoE

    class MoEMarker(MoE):
        def __init__(self) -> None:
            super(MoE, self).__init__()  # nn.Module's: no DeepSpeed experts, gates or groups are built
            self.num_experts = num_experts

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the engine calls this to create groups; dsx3d created and registered them already

        def forward(self, *args: object, **kwargs: object) -> NoReturn:
            raise RuntimeError("MoEMarker only marks a stage for DeepSpeed; it never runs")

    return MoEMarker()


def keep_pipeline_checkpoints(ds_engine: PipeEngine) -> None:
    """DeepSpeed writes an engine with MoE layers in its per-expert format, which only knows its own MoE
    modules; pipeline stages save their layers themselves. The MoE flag is what the optimizer set-up and the
    BF16 optimizer's gradient reduction read, so it stays on, and only save/load see it off."""
    for name in ("save_checkpoint", "load_checkpoint"):
        method = getattr(ds_engine, name)

        @functools.wraps(method)
        def without_moe_format(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            ds_engine.has_moe_layers = False
            try:
                return _method(*args, **kwargs)
            finally:
                ds_engine.has_moe_layers = True

        setattr(ds_engine, name, without_moe_format)
