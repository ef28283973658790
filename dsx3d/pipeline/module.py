"""HF causal LM -> `deepspeed.pipe.PipelineModule` whose stages hold TP-sharded HF layers.

Pipeline layers: [embedding, decoder 0 .. L-1, epilogue (final norm), head]. With tied embeddings the first
and last items are `TiedLayerSpec`s of one key, so DeepSpeed all-reduces the shared weight's gradient over
the (first stage, last stage) pair of each (dp, tp) index.

With expert parallelism (ep > 1) the ranks of an EP group hold different experts, so a layer with experts is
saved by each of them, `layer_XX-model_YY-expert_ZZ-model_states.pt` (ZZ its index in the EP group), and
loaded back from that file; other layers keep DeepSpeed's files, written by dp rank 0.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from transformers import PretrainedConfig

from dsx3d.boundary_types import DSCheckpointEngine, DSLayerSpec, PipeEngine
from dsx3d.distributed import comm
from dsx3d.distributed.context_parallel import CPContext, create_cp_group
from dsx3d.distributed.expert_parallel.experts import ExpertContext
from dsx3d.distributed.expert_parallel.groups import ExpertGroups, create_expert_groups, moe_marker
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.topology import pipeline_topology
from dsx3d.models.family_spec import FamilySpec, resolve_family
from dsx3d.models.lora import LoraSpec
from dsx3d.models.pipe_layers import (
    DecoderLayerPipe,
    EmbeddingPipe,
    EpiloguePipe,
    HeadPipe,
    LayerBuilder,
    TiedEmbeddingPipe,
    tied_head_forward,
)
from dsx3d.models.weights import WeightSource
from dsx3d.pipeline.split import bounds_from_stage_layers, looped_placement, stage_layers_for
from dsx3d.plan.layout import Layout


class StagedPipelineModule(PipelineModule):
    """A PipelineModule with our stage bounds, and the TP context bound to DeepSpeed's own grid before any
    layer is built (the grid is created inside PipelineModule.__init__, right before partitioning)."""

    def __init__(
        self,
        layers: list[Any],
        *,
        bounds: list[int],
        tp: TPContext,
        builder: LayerBuilder,
        chunks: list[list[int]] | None = None,
        order: list[int] | None = None,
        **kwargs: object,
    ):
        self.__dict__["_dsx3d_bounds"] = bounds
        self.__dict__["_dsx3d_all_chunks"] = chunks
        self.__dict__["_dsx3d_order"] = order
        self.__dict__["dsx3d_chunks"] = None
        self.__dict__["dsx3d_chunk"] = None
        self.__dict__["_dsx3d_tp"] = tp
        self.__dict__["dsx3d_builder"] = builder
        super().__init__(layers, **kwargs)

    def allreduce_tied_weight_gradients(self) -> None:
        """DeepSpeed's, skipping a frozen tied weight (LoRA), which has no gradient."""
        for key, tied in self.tied_comms.items():
            for attr_name in tied["weight_attr"]:
                weight = self._recursive_getattr(self.tied_modules[key], attr_name)
                if weight.grad is not None:
                    comm.all_reduce_sum(weight.grad, tied["group"])

    def _index_tied_modules(self) -> dict[str, Any]:
        """DeepSpeed's, which marks every parameter of a tied module on the later stages as a replica (left out
        of the gradient norm); only the tied weights are: a tied head's own bias (Phi) lives on the last stage
        alone and counts there."""
        comms: dict[str, Any] = super()._index_tied_modules()
        for key, tied in comms.items():
            shared = {id(self._recursive_getattr(self.tied_modules[key], a)) for a in tied["weight_attr"]}
            for p in self.tied_modules[key].parameters():
                if id(p) not in shared:
                    p.ds_pipe_replicated = False
        return comms

    def _partition_layers(self, method: str = "") -> None:
        self.parts = list(self._dsx3d_bounds)
        self._dsx3d_tp.bind(self._grid.get_slice_parallel_group())
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
        if self._dsx3d_all_chunks is not None:
            self.__dict__["dsx3d_chunks"] = self._dsx3d_all_chunks[stage]

    def forward(self, forward_input: Any) -> Any:
        """With virtual stages, the layers of chunk `dsx3d_chunk` only (set by the schedule around each pass,
        `dsx3d.pipeline.interleaved_schedule`); else the whole stage, as DeepSpeed's."""
        if self.dsx3d_chunks is None or self.dsx3d_chunk is None:
            return super().forward(forward_input)
        lo, hi = self.dsx3d_chunks[self.dsx3d_chunk], self.dsx3d_chunks[self.dsx3d_chunk + 1]
        funcs: list[Any] = self.__dict__["forward_funcs"]  # a plain list attribute of DeepSpeed's module
        self.__dict__["forward_funcs"] = funcs[lo:hi]
        try:
            return super().forward(forward_input)
        finally:
            self.__dict__["forward_funcs"] = funcs

    @property
    def expert_context(self) -> ExpertContext:
        return self.dsx3d_builder.experts

    def holds_expert_shards(self) -> bool:
        """Whether this stage has parameters split over the EP group (DeepSpeed must treat it as MoE)."""
        return any(holds_ep_shards(layer) for layer in self.forward_funcs if isinstance(layer, nn.Module))

    def _natural(self, local_layer_idx: int) -> int:
        """The local index DeepSpeed's file naming adds `_local_start` to, such that a layer file is named by the
        item's place in [embedding, decoders, norm, head] also with virtual stages (whose items DeepSpeed holds
        in rank order): checkpoints, `dsx3d export` and resharding read the same file names at any v."""
        if self._dsx3d_order is None:
            return local_layer_idx
        return int(self._dsx3d_order[self._local_start + local_layer_idx]) - int(self._local_start)

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        return list(super().ckpt_layer_path_list(ckpt_dir, self._natural(local_layer_idx)))

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        path = super().ckpt_layer_path(ckpt_dir, self._natural(local_layer_idx))
        layer = self.forward_funcs[local_layer_idx]
        if isinstance(layer, nn.Module) and holds_ep_shards(layer):
            path = path.replace("-model_states.pt", f"-expert_{self.expert_context.ep_rank:02d}-model_states.pt")
        return path

    def save_state_dict(self, save_dir: str, checkpoint_engine: DSCheckpointEngine, exclude_frozen_params: bool = False) -> None:
        """DeepSpeed's save (dp rank 0 writes every layer), except that each rank of the first EP group also
        writes the layers holding its experts."""
        if self.expert_context.ep == 1:
            return super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
        dp_rank = self._grid.data_parallel_id
        if dp_rank >= self.expert_context.ep:
            return None
        checkpoint_engine.makedirs(save_dir, exist_ok=True)
        for idx, layer in enumerate(self.forward_funcs):
            if not isinstance(layer, nn.Module) or (dp_rank != 0 and not holds_ep_shards(layer)):
                continue
            state = layer.state_dict()
            if exclude_frozen_params:
                for name in self._get_frozen_parameter_names(layer):
                    del state[name]
            if checkpoint_engine.preserves_storage_sharing():
                state = clone_tensors_for_torch_save(state)
            checkpoint_engine.save(state_dict=state, path=self.ckpt_layer_path(save_dir, idx))
        return None

    def load_state_dir(self, load_dir: str, checkpoint_engine: DSCheckpointEngine, strict: bool = True) -> None:
        """With ep > 1 every layer is read from the one file this rank's layout wrote (a resume keeps the
        layout; resharding goes through an export)."""
        if self.expert_context.ep == 1:
            return super().load_state_dir(load_dir, checkpoint_engine, strict)
        for idx, layer in enumerate(self.forward_funcs):
            if isinstance(layer, nn.Module):
                state = checkpoint_engine.load(self.ckpt_layer_path(load_dir, idx), map_location="cpu")
                layer.load_state_dict(state, strict=strict)
        return None


def holds_ep_shards(module: nn.Module) -> bool:
    """Parameters split over an EP group carry DeepSpeed's expert mark (`allreduce = False`)."""
    return any(getattr(p, "allreduce", True) is False for p in module.parameters())


def release_last_stage_outputs(engine: PipeEngine) -> None:
    """DeepSpeed's PipelineEngine keeps every stage's outputs in `pipe_buffers["outputs"]` until their
    backward, which frees them on every stage but the last (runtime/pipe/engine.py, _exec_backward_pass
    returns early there). The last stage's outputs are the logits, b*s*V/tp of them, and it has two buffers:
    one micro-batch's logits would stay alive through the next micro-batch's loss. This drops them once their backward has run."""
    if not engine.is_last_stage():
        return
    from deepspeed.runtime.pipe import schedule

    table = dict(engine._INSTRUCTION_MAP)
    backward = table[schedule.BackwardPass]

    def backward_then_release(self: PipeEngine, buffer_id: int) -> None:
        backward(self, buffer_id)
        self.pipe_buffers["outputs"][buffer_id] = None

    table[schedule.BackwardPass] = backward_then_release
    engine._INSTRUCTION_MAP = table


def stage_bounds(config: PretrainedConfig, pp: int, seq_len: int, stage_layers: list[int] | None) -> list[int]:
    """Boundaries over the pipeline items [embedding, L decoder layers, epilogue, head] (with virtual stages,
    `pp` is the number of stages, ranks x chunks)."""
    return bounds_from_stage_layers(stage_layers_for(config, pp, seq_len, stage_layers), num_extra_first=1, num_extra_last=2)


def engine_bounds(
    config: PretrainedConfig, pp: int, seq_len: int, stage_layers: list[int] | None, virtual_stages: int = 1, placement: str = "looped"
) -> tuple[list[int], list[int] | None, list[list[int]] | None]:
    """(the ranks' bounds as the engine's module holds them, the items in rank order, each rank's chunk bounds):
    `stage_bounds` over pp x v stages, and with virtual stages their placement on the ranks (rank r holds
    stages r, pp + r, ... or r and 2 pp - 1 - r: contiguous for DeepSpeed). A checkpoint records the first."""
    bounds = stage_bounds(config, pp * virtual_stages, seq_len, stage_layers)
    if virtual_stages == 1:
        return bounds, None, None
    order, ranks, chunks = looped_placement(bounds, pp, virtual_stages, placement)
    return ranks, order, chunks


def pipeline_specs(builder: LayerBuilder, plan: FamilySpec, pp: int, both_ends_on_one_rank: bool = False) -> list[DSLayerSpec]:
    """The pipeline items. A tied embedding is built once per rank from the first spec that rank holds (DeepSpeed
    reuses it for the second): it installs the head too where the rank holds both ends (pp = 1, V placement)."""
    n = builder.skeleton.num_layers
    both = pp == 1 or both_ends_on_one_rank
    if plan.tied:
        first: DSLayerSpec = TiedLayerSpec("embed", TiedEmbeddingPipe, builder, True, both, tied_weight_attr=["embed.weight"])
        last: DSLayerSpec = TiedLayerSpec(
            "embed", TiedEmbeddingPipe, builder, both, True, forward_fn=tied_head_forward, tied_weight_attr=["embed.weight"]
        )
    else:
        first, last = LayerSpec(EmbeddingPipe, builder), LayerSpec(HeadPipe, builder)
    return [first, *(LayerSpec(DecoderLayerPipe, builder, i) for i in range(n)), LayerSpec(EpiloguePipe, builder), last]


def build_pipeline(
    config: PretrainedConfig,
    layout: Layout,
    source: WeightSource,
    *,
    seq_len: int,
    stage_layers: list[int] | None = None,
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    lora: LoraSpec | None = None,
    loss_tile_tokens: int = 0,
    virtual_stages: int = 1,
    placement: str = "looped",
) -> StagedPipelineModule:
    """Build this rank's stage. Needs an initialised process group (dsx3d.distributed.comm.init_distributed).
    `sequence_parallel` takes effect with tp > 1 for families that allow it (`LayerBuilder`). With
    `virtual_stages` > 1 the rank holds that many chunks, placed `placement` ("looped" or "v",
    `dsx3d.pipeline.split.stage_of`)."""
    plan = resolve_family(config)
    rank = comm.get_rank()
    place = layout.placement(rank)
    tp = TPContext(rank=place.tp, size=layout.tp, sequence_parallel=sequence_parallel and layout.tp > 1)
    experts = ExpertContext(tp, ep_rank=layout.ep_rank(rank), ep=layout.ep)
    cp = CPContext(rank=place.cp, size=layout.cp)
    if layout.cp > 1:  # before DeepSpeed's grid: every rank creates the groups in the same order
        cp.bind(create_cp_group(layout.cp_groups(), rank))
    groups: ExpertGroups | None = None
    if layout.ep > 1:
        groups = create_expert_groups(layout.ep_groups(), layout.edp_groups(), rank)
        experts.group, experts.group_name = groups.ep_group, groups.name
    builder = LayerBuilder(config, plan, tp, source, experts, lora, cp)
    builder.loss_tile_tokens = loss_tile_tokens
    specs = pipeline_specs(builder, plan, layout.pp, both_ends_on_one_rank=placement == "v")
    bounds, order, chunks = engine_bounds(config, layout.pp, seq_len, stage_layers, virtual_stages, placement)
    if order is not None:
        specs = [specs[i] for i in order]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return builder.loss(logits, labels)

    module = StagedPipelineModule(
        specs,
        bounds=bounds,
        chunks=chunks,
        order=order if virtual_stages > 1 else None,
        tp=tp,
        builder=builder,
        topology=pipeline_topology(layout),
        loss_fn=loss_fn,
        partition_method="dsx3d",
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        checkpointable_layers=["DecoderLayerPipe"],
    )
    module.dsx3d_expert_groups = groups
    if groups is not None and module.holds_expert_shards():
        module.dsx3d_moe_marker = moe_marker(layout.ep)
    return module
