"""The one engine builder: recipe -> checker -> layout -> TP-sharded pipeline stages -> DeepSpeed engine.

`dsx3d train`, `dsx3d verify`, the Trainer drop-in and accelerate integration all call `build_engine`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from dsx3d.checker import check_recipe, raise_for_errors
from dsx3d.distributed import comm
from dsx3d.distributed.tensor_parallel.random import seed_ranks
from dsx3d.ds_config import build_ds_config
from dsx3d.errors import UserError
from dsx3d.hf_config import load_hf_config
from dsx3d.layout import Layout, RankPlacement
from dsx3d.models.pipeline import StagedPipelineModule, build_pipeline, release_last_stage_outputs
from dsx3d.models.shards import Shard, local_hf_shards
from dsx3d.models.weights import WeightSource
from dsx3d.recipe import Recipe

log = logging.getLogger("dsx3d")

MicroBatch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Engine3D:
    """A DeepSpeed PipelineEngine with the layout it runs under."""

    ds_engine: Any
    module: StagedPipelineModule
    layout: Layout
    placement: RankPlacement
    hf_config: PretrainedConfig
    ds_config: dict[str, Any]

    def train_step(self, micro_batches: Iterator[MicroBatch]) -> float:
        """One optimizer step over gradient_accumulation_steps micro-batches of this DP rank; the loss is
        the mean over micro-batches and DP ranks, known on every rank."""
        return float(self.ds_engine.train_batch(data_iter=micro_batches))

    def eval_loss(self, micro_batches: Iterator[MicroBatch]) -> float:
        loss = self.ds_engine.eval_batch(data_iter=micro_batches, compute_loss=True, reduce_output="avg")
        return float(loss)

    @property
    def grad_norm(self) -> float:
        norm = self.ds_engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.ds_engine.get_lr()[0])

    def hf_shards(self) -> dict[str, Shard]:
        return local_hf_shards(self.module, self.placement.tp)


def default_weight_source(recipe: Recipe, hf_config: PretrainedConfig) -> WeightSource:
    """Checkpoint slices for `model.name_or_path`, else a fresh layout-independent initialisation."""
    if recipe.model.name_or_path is not None:
        from dsx3d.checkpoint.source import checkpoint_source

        return checkpoint_source(recipe.model.name_or_path, hf_config, trust_remote_code=recipe.model.trust_remote_code)
    from dsx3d.models.init_source import InitSource

    return InitSource(hf_config, recipe.train.seed)


def build_engine(
    recipe: Recipe,
    *,
    hf_config: PretrainedConfig | None = None,
    source: WeightSource | None = None,
    ds_overrides: dict[str, Any] | None = None,
    param_groups: Callable[[StagedPipelineModule], list[dict[str, Any]]] | None = None,
) -> Engine3D:
    """Build this rank's stage and its DeepSpeed engine. The process group must exist
    (dsx3d.distributed.comm.init_distributed); the world size is the group's. `param_groups` splits the stage's
    parameters into optimizer groups (the Trainer drop-in exempts biases and norms from weight decay, as HF
    does); by default every trainable parameter is in one group."""
    world = comm.get_world_size()
    hf_config = hf_config if hf_config is not None else load_hf_config(recipe.model)
    raise_for_errors(check_recipe(recipe, world_size=world, hf_config=hf_config))
    layout = recipe.layout(world)
    if layout.world_size != world:
        raise UserError.single("parallel", f"dp*tp*pp={layout.world_size}", f"the job has {world} processes", "match the launcher's process count")
    ds_config = build_ds_config(recipe, world)
    if ds_overrides:
        from dsx3d.ds_config import deep_merge

        ds_config = deep_merge(ds_config, ds_overrides)
    module = build_pipeline(
        hf_config,
        layout,
        source if source is not None else default_weight_source(recipe, hf_config),
        seq_len=recipe.train.seq_len,
        stage_layers=recipe.parallel.stage_layers,
        activation_checkpointing=recipe.train.activation_checkpointing,
        sequence_parallel=recipe.parallel.sequence_parallel,
    )
    import deepspeed

    params: Any = param_groups(module) if param_groups is not None else [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=ds_config)
    release_last_stage_outputs(engine)
    placement = layout.placement(comm.get_rank())
    # dropout: the same replicated stream on the ranks of a TP group (a resume restores each rank's state)
    seed_ranks(recipe.train.seed, pp_rank=placement.pp, dp_rank=placement.dp)
    return Engine3D(engine, module, layout, placement, hf_config, ds_config)
