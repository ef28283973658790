"""HF causal LM -> `deepspeed.pipe.PipelineModule` whose stages hold TP-sharded HF layers.

Pipeline layers: [embedding, decoder 0 .. L-1, epilogue (final norm), head]. With tied embeddings the first
and last items are `TiedLayerSpec`s of one key, so DeepSpeed all-reduces the shared weight's gradient over
the (first stage, last stage) pair of each (dp, tp) index.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from transformers import PretrainedConfig

from dsx3d.distributed import comm
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.layout import Layout
from dsx3d.models.family import FamilySpec, resolve_family
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
from dsx3d.partition import bounds_from_stage_layers, stage_layers_for


class StagedPipelineModule(PipelineModule):
    """A PipelineModule with our stage bounds, and the TP context bound to DeepSpeed's own grid before any
    layer is built (the grid is created inside PipelineModule.__init__, right before partitioning)."""

    def __init__(self, layers: list[Any], *, bounds: list[int], tp: TPContext, builder: LayerBuilder, **kwargs: Any):
        self.__dict__["_dsx3d_bounds"] = bounds
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

    def _partition_layers(self, method: str = "") -> None:
        self.parts = list(self._dsx3d_bounds)
        self._dsx3d_tp.bind(self._grid.get_slice_parallel_group())
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def release_last_stage_outputs(engine: Any) -> None:
    """DeepSpeed's PipelineEngine keeps every stage's outputs in `pipe_buffers["outputs"]` until their
    backward, which frees them on every stage but the last (runtime/pipe/engine.py, _exec_backward_pass
    returns early there). The last stage's outputs are the logits, b*s*V/tp of them, and it has two buffers:
    one micro-batch's logits stayed alive through the next micro-batch's loss (measured: a 16 MiB logits
    tensor at a 283 MiB peak, h512 V16384 tp2 pp2). This drops them once their backward has run."""
    if not engine.is_last_stage():
        return
    from deepspeed.runtime.pipe import schedule

    table = dict(engine._INSTRUCTION_MAP)
    backward = table[schedule.BackwardPass]

    def backward_then_release(self: Any, buffer_id: int) -> None:
        backward(self, buffer_id)
        self.pipe_buffers["outputs"][buffer_id] = None

    table[schedule.BackwardPass] = backward_then_release
    engine._INSTRUCTION_MAP = table


def stage_bounds(config: PretrainedConfig, pp: int, seq_len: int, stage_layers: list[int] | None) -> list[int]:
    """Boundaries over the pipeline items [embedding, L decoder layers, epilogue, head]."""
    return bounds_from_stage_layers(stage_layers_for(config, pp, seq_len, stage_layers), num_extra_first=1, num_extra_last=2)


def pipeline_specs(builder: LayerBuilder, plan: FamilySpec, pp: int) -> list[Any]:
    n = builder.skeleton.num_layers
    if plan.tied:
        first: Any = TiedLayerSpec("embed", TiedEmbeddingPipe, builder, True, pp == 1, tied_weight_attr=["embed.weight"])
        last: Any = TiedLayerSpec(
            "embed", TiedEmbeddingPipe, builder, pp == 1, True, forward_fn=tied_head_forward, tied_weight_attr=["embed.weight"]
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
) -> StagedPipelineModule:
    """Build this rank's stage. Needs an initialised process group (dsx3d.distributed.comm.init_distributed).
    `sequence_parallel` takes effect with tp > 1 for families that allow it (`LayerBuilder`)."""
    plan = resolve_family(config)
    tp = TPContext(
        rank=layout.placement(comm.get_rank()).tp,
        size=layout.tp,
        sequence_parallel=sequence_parallel and layout.tp > 1,
    )
    builder = LayerBuilder(config, plan, tp, source, lora)
    bounds = stage_bounds(config, layout.pp, seq_len, stage_layers)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return builder.loss(logits, labels)

    return StagedPipelineModule(
        pipeline_specs(builder, plan, layout.pp),
        bounds=bounds,
        tp=tp,
        builder=builder,
        topology=layout.topology,
        loss_fn=loss_fn,
        partition_method="dsx3d",
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        checkpointable_layers=["DecoderLayerPipe"],
    )
