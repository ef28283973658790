"""The one engine builder: recipe -> checker -> layout -> TP-sharded model -> DeepSpeed engine.

`dsx3d train`, `dsx3d verify`, the Trainer drop-in and accelerate integration all call `build_engine`.
With parallel.pp > 1 the model is a `PipelineModule` of TP-sharded stages and DeepSpeed runs its
`PipelineEngine` (ZeRO-0/1). With pp = 1 it is one plain module of the same items (dsx3d.models.sequential)
and DeepSpeed runs its regular engine, with our dp/tp process groups as its mpu, so ZeRO-0/1/2/3 all run.
`Engine3D` hides which: the train loop, verify and the Trainer call the same methods on both.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PretrainedConfig

from dsx3d.boundary_types import DSConfig, DSEngine, JSONObject, ParamGroup, PipeEngine
from dsx3d.checks import check_recipe, raise_for_errors
from dsx3d.data.context_parallel import sliced
from dsx3d.distributed import comm
from dsx3d.distributed.context_parallel import CPContext, create_cp_group
from dsx3d.distributed.expert_parallel.groups import keep_pipeline_checkpoints, register_with_deepspeed
from dsx3d.distributed.grad_clip import install_fp32_clipping
from dsx3d.distributed.groups import DataTensorParallelGroups
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.random import seed_ranks
from dsx3d.engine.bf16_norm import count_empty_as_zero
from dsx3d.engine.chunked_adam import step_engine_in_pieces
from dsx3d.engine.fp16_wrapper_state import undo_initialising_step
from dsx3d.errors import UserError
from dsx3d.models.buffer_dtypes import cast_buffers_as_hf, run_dtype_of
from dsx3d.models.lora import LoraSpec
from dsx3d.models.sequential import SequentialLM, build_sequential
from dsx3d.models.shape import model_dim
from dsx3d.models.shards import Shard, local_hf_shards
from dsx3d.models.weights import WeightSource
from dsx3d.pipeline.lean_step import trim_engine
from dsx3d.pipeline.module import StagedPipelineModule, build_pipeline, release_last_stage_outputs
from dsx3d.pipeline.registry import get_schedule
from dsx3d.plan.layout import Layout, RankPlacement
from dsx3d.recipe.ds_config import build_ds_config
from dsx3d.recipe.hf_config import load_hf_config
from dsx3d.recipe.lr_schedule import scheduler_factory
from dsx3d.recipe.schema import Recipe

log = logging.getLogger("dsx3d")

MicroBatch = tuple[Any, Any]
"""(input_ids, labels) or, for masked rows, (input_ids, (labels, norm)) (dsx3d.data.stream); for packed rows
input_ids is (input_ids, position_ids) (dsx3d.models.packed)."""


@dataclass
class Engine3D:
    """A DeepSpeed engine (PipelineEngine with pp > 1, the regular one with pp = 1) with its layout."""

    ds_engine: DSEngine | PipeEngine
    module: StagedPipelineModule | SequentialLM
    layout: Layout
    placement: RankPlacement
    hf_config: PretrainedConfig
    ds_config: DSConfig
    mpu: DataTensorParallelGroups | None = None
    """The dp/tp groups of a pp = 1 engine; None with a pipeline (the engine's grid holds them)."""

    @property
    def pipelined(self) -> bool:
        return self.mpu is None

    @property
    def holds_loss(self) -> bool:
        """Whether this rank's pipeline stage computes the loss (the last stage's rank; rank 0 of the pipe
        with a V-shaped placement); True without a pipeline."""
        return bool(self.ds_engine.is_last_stage()) if self.pipelined else True

    @property
    def zero_stage(self) -> int:
        zero = cast(JSONObject, self.ds_config.get("zero_optimization", {}))
        return int(cast(int, zero.get("stage", 0)))

    def train_step(self, micro_batches: Iterator[MicroBatch]) -> float:
        """One optimizer step over gradient_accumulation_steps micro-batches of this DP rank; the loss is
        the mean over micro-batches and DP ranks, known on every rank (with (labels, norm) micro-batches, the
        per-token mean over the global batch). With cp > 1 each micro-batch is cut to this rank's slice
        of every sequence here (dsx3d.data.context_parallel)."""
        micro_batches = sliced(micro_batches, self.layout.cp, self.placement.cp)
        if self.pipelined:
            return float(self.ds_engine.train_batch(data_iter=micro_batches))
        engine, m = self.ds_engine, self.ds_engine.gradient_accumulation_steps()
        losses = []
        for _ in range(m):
            input_ids, labels = next(micro_batches)
            loss = engine(input_ids, labels)
            engine.backward(loss)  # scales by 1/m; ZeRO/DDP averages the gradients over the DP group
            engine.step()  # applies the optimizer at the m-th micro-batch only
            losses.append(float(loss.detach()))
        return self._dp_mean(sum(losses) / m)

    def eval_loss(self, micro_batches: Iterator[MicroBatch]) -> float:
        """The mean loss over gradient_accumulation_steps micro-batches and the DP ranks, without gradients."""
        micro_batches = sliced(micro_batches, self.layout.cp, self.placement.cp)
        if self.pipelined:
            loss = self.ds_engine.eval_batch(data_iter=micro_batches, compute_loss=True, reduce_output="avg")
            return float(loss)
        engine, m = self.ds_engine, self.ds_engine.gradient_accumulation_steps()
        was_training = engine.module.training
        engine.eval()
        try:
            with torch.no_grad():
                total = sum(float(engine(*next(micro_batches))) for _ in range(m))
        finally:
            engine.train(was_training)
        return self._dp_mean(total / m)

    def _dp_mean(self, local: float) -> float:
        assert self.mpu is not None
        t = torch.tensor([local], dtype=torch.float64, device=self.ds_engine.device)  # nccl: on the GPU
        comm.all_reduce_sum(t, self.mpu.get_data_parallel_group())
        return float(t.item()) / self.layout.data_size

    @property
    def grad_norm(self) -> float:
        norm = self.ds_engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.ds_engine.get_lr()[0])

    def gathered(self, params: Iterable[torch.nn.Parameter]) -> contextlib.AbstractContextManager[Any]:
        """Inside, ZeRO-3's partitioned `params` hold their whole (TP-shard) tensors; a collective over the DP
        group. A no-op for the other stages, whose parameters are always whole."""
        if self.zero_stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)

    def hf_shards(self) -> dict[str, Shard]:
        """{hf name: (tensor, TP dim, tp rank)} of this rank's parameters. A collective with ZeRO-3."""
        with self.gathered(self.module.parameters()):
            return local_hf_shards(self.module, self.placement.tp)


def _zero3_partitioner(ds_config: dict[str, Any], mpu: DataTensorParallelGroups) -> Callable[[torch.nn.Module], None] | None:
    """With ZeRO-3, partition each model item over the DP group as soon as its weights are read (what
    `deepspeed.zero.Init` does to a module built inside it), so a rank never holds the whole model; the
    engine then finds the parameters partitioned already. It no longer casts them then ("ZeRO-Init params
    are already at the configured dtype"), so bf16/fp16 parameters are cast here first, as the engine would
    (parameters only: buffers such as rotary tables stay fp32). None for the other stages."""
    if int(ds_config.get("zero_optimization", {}).get("stage", 0)) < 3:
        return None
    import deepspeed

    dtype = run_dtype_of(ds_config)

    def partition(item: torch.nn.Module) -> None:
        if dtype != torch.float32:
            for p in item.parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        deepspeed.zero.Init(
            module=item, data_parallel_group=mpu.get_data_parallel_group(), config_dict_or_path=ds_config, mpu=mpu
        )

    return partition


def lora_spec(recipe: Recipe) -> LoraSpec | None:
    """peft's config for the recipe's `model.lora` (None: full fine-tuning)."""
    if recipe.model.lora is None:
        return None
    from dsx3d.models.lora import peft_config_from

    return LoraSpec(peft_config_from(recipe.model.lora), recipe.train.seed)


def _expert_param_groups(module: StagedPipelineModule, params: list[torch.nn.Parameter]) -> list[ParamGroup]:
    """Expert parameters split over the EP group get their own optimizer groups (DeepSpeed's `moe` groups),
    which ZeRO partitions over the expert-data-parallel group; the groups are registered first."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    register_with_deepspeed(module.dsx3d_expert_groups)
    if params and isinstance(params[0], dict):
        groups = [{"name": f"params-{i}", **group} for i, group in enumerate(params)]
    else:
        groups = [{"params": params, "name": "dense-params"}]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def default_weight_source(recipe: Recipe, hf_config: PretrainedConfig) -> WeightSource:
    """Checkpoint slices for `model.name_or_path`, else a fresh layout-independent initialisation."""
    if recipe.model.name_or_path is not None:
        from dsx3d.checkpoint.hf.source import checkpoint_source

        return checkpoint_source(recipe.model.name_or_path, hf_config, trust_remote_code=recipe.model.trust_remote_code)
    from dsx3d.models.init_source import InitSource

    return InitSource(hf_config, recipe.train.seed)


def build_engine(
    recipe: Recipe,
    *,
    hf_config: PretrainedConfig | None = None,
    source: WeightSource | None = None,
    ds_overrides: dict[str, Any] | None = None,
    param_groups: Callable[[torch.nn.Module], list[ParamGroup]] | None = None,
    check_data: bool = False,
    client_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> Engine3D:
    """Build this rank's model (its pipeline stage, or with pp = 1 the whole TP-sharded model) and its
    DeepSpeed engine. The process group must exist (dsx3d.distributed.comm.init_distributed); the world size
    is the group's. `param_groups` splits the model's
    parameters into optimizer groups (the Trainer drop-in exempts biases and norms from weight decay, as HF
    does); by default every trainable parameter is in one group. A top-level `ds_overrides` key set to None
    removes that section (`"scheduler": None`: no LR scheduler in the engine at all; without a scheduler
    section the engine steps the recipe's HF schedule, dsx3d.recipe.lr_schedule). `check_data` adds the checker's rules on the
    recipe's data pipeline (for `dsx3d train`, which reads it). `client_optimizer` builds DeepSpeed's client
    optimizer over the param groups (with an "optimizer": None override)."""
    world = comm.get_world_size()
    hf_config = hf_config if hf_config is not None else load_hf_config(recipe.model)
    raise_for_errors(check_recipe(recipe, world_size=world, hf_config=hf_config, data=check_data))
    layout = recipe.layout(world)
    if layout.world_size != world:
        raise UserError.single("parallel", f"dp*tp*pp={layout.world_size}", f"the job has {world} processes", "match the launcher's process count")
    ds_config = build_ds_config(recipe, world, hidden_size=model_dim(hf_config, "hidden_size"))
    # the recipe's schedule is HF's, unless a "scheduler" section brings DeepSpeed's (or an override of None
    # asks for none: the Trainer's HF scheduler sets the rates itself)
    lr_scheduler = None
    if "scheduler" not in ds_config and "scheduler" not in (ds_overrides or {}):
        lr_scheduler = scheduler_factory(recipe.train)
    if ds_overrides:
        from dsx3d.recipe.ds_config import merge_overrides

        ds_config = merge_overrides(ds_config, ds_overrides)
    placement = layout.placement(comm.get_rank())
    source = source if source is not None else default_weight_source(recipe, hf_config)
    module: StagedPipelineModule | SequentialLM
    mpu: DataTensorParallelGroups | None = None
    lora = lora_spec(recipe)
    if layout.pp > 1:
        module = build_pipeline(
            hf_config,
            layout,
            source,
            seq_len=recipe.train.seq_len,
            stage_layers=recipe.parallel.stage_layers,
            activation_checkpointing=recipe.train.activation_checkpointing,
            sequence_parallel=recipe.parallel.sequence_parallel,
            lora=lora,
            loss_tile_tokens=recipe.train.loss_tile_tokens,
            virtual_stages=recipe.parallel.virtual_stages,
            placement=get_schedule(recipe.parallel.schedule).placement,
        )
    else:
        mpu = DataTensorParallelGroups(layout.tp_groups(), layout.data_groups())
        tp = TPContext(
            rank=placement.tp, size=layout.tp, sequence_parallel=recipe.parallel.sequence_parallel and layout.tp > 1
        )
        tp.bind(mpu.get_tensor_model_parallel_group())
        cp = CPContext(rank=placement.cp, size=layout.cp)
        if layout.cp > 1:
            cp.bind(create_cp_group(layout.cp_groups(), comm.get_rank()))
        module = build_sequential(
            hf_config,
            tp,
            source,
            activation_checkpointing=recipe.train.activation_checkpointing,
            after_item=_zero3_partitioner(ds_config, mpu),
            lora=lora,
            loss_tile_tokens=recipe.train.loss_tile_tokens,
            cp=cp,
        )
    # bf16/fp16: buffers as HF's model in that dtype has them (DeepSpeed casts only the parameters)
    cast_buffers_as_hf(module, hf_config, run_dtype_of(ds_config))
    import deepspeed

    params: Any = param_groups(module) if param_groups is not None else [p for p in module.parameters() if p.requires_grad]
    # experts split over an EP group (pp > 1 only: the checker refuses ep > 1 at pp = 1)
    moe = isinstance(module, StagedPipelineModule) and getattr(module, "dsx3d_moe_marker", None) is not None
    if moe:
        params = _expert_param_groups(module, params)  # type: ignore[arg-type]
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=params, config=ds_config, mpu=mpu, lr_scheduler=lr_scheduler,
        optimizer=client_optimizer(params) if client_optimizer is not None else None,
    )
    undo_initialising_step(engine)  # the fp16 wrappers' zero-gradient step would put AdamW one count ahead
    step_engine_in_pieces(engine)  # Adam over a flat CPU partition in pieces (dsx3d/engine/chunked_adam.py)
    if layout.pp > 1:
        release_last_stage_outputs(engine)
        count_empty_as_zero(engine)  # a stage without decoder layers may count no gradient in the norm
        get_schedule(recipe.parallel.schedule).install(engine, recipe)
        trim_engine(engine)  # ZeRO-1's per-parameter bookkeeping hooks (dsx3d/pipeline/lean_step.py)
    if moe:
        keep_pipeline_checkpoints(engine)
    module.dsx3d_builder.release_source()  # the weights are in the engine; the source's copies can go
    if not engine.zero_optimization() and not engine.bfloat16_enabled() and not engine.fp16_enabled():
        install_fp32_clipping(engine, placement.tp)
    # dropout: the same replicated stream on the ranks of a TP group, its own on every DP and CP rank (a
    # resume restores each rank's state)
    seed_ranks(recipe.train.seed, pp_rank=placement.pp, dp_rank=placement.dp, cp_rank=placement.cp)
    return Engine3D(engine, module, layout, placement, hf_config, ds_config, mpu)
