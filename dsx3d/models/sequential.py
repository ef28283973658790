"""The model without a pipeline (parallel.pp = 1): one plain nn.Module for DeepSpeed's regular engine.

It holds the same pipeline items as a one-stage `StagedPipelineModule` ([embedding, decoder 0 .. L-1,
epilogue, head], built by the same LayerBuilder, TP-sharded by the same plan-driven layers) under the same
parameter names ("3.layer.mlp.up_proj.weight", "tied_modules.embed.embed.weight"), so exports, universal
checkpoints and the offline exporter see one naming for both engines. Its forward runs the items in order
and returns the vocab-parallel loss, which is what `deepspeed.initialize(model=...)` trains with ZeRO-0/1/2/3.

With tied embeddings the LM head uses the embedding's parameter itself (each TP rank its own vocab shard);
the head module is also registered here (`tied_head`) because ZeRO-3 gathers a partitioned parameter only
around the forward of a module inside the engine's module tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from dsx3d.distributed.context_parallel import CPContext
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.models.family_spec import resolve_family
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

TIED_KEY = "embed"
"""The key of the tied embedding, as in pipeline.pipeline_specs (`tied_modules.embed`)."""


class SequentialLM(nn.Module):
    """input_ids, labels -> mean causal-LM loss over this rank's micro-batch (logits stay vocab-sharded)."""

    dsx3d_builder: LayerBuilder

    def __init__(
        self,
        builder: LayerBuilder,
        activation_checkpointing: bool = False,
        after_item: Callable[[nn.Module], None] | None = None,
    ):
        """`after_item` is called on each item as soon as its weights are read (ZeRO-3 partitions it there, so
        no rank ever holds more than its partitions and one item's whole tensors)."""
        super().__init__()
        def done(item: nn.Module) -> None:
            builder.release_source()  # one item's source tensors at a time
            if after_item is not None:
                after_item(item)

        self.__dict__["dsx3d_builder"] = builder  # plain attribute, outside nn.Module's registry
        self.activation_checkpointing = activation_checkpointing
        n = builder.skeleton.num_layers
        self.tied_modules = nn.ModuleDict()
        self._tied = builder.plan.tied
        if self._tied:
            self.tied_modules[TIED_KEY] = TiedEmbeddingPipe(builder, True, True)
            self.tied_head = getattr(builder.skeleton.lm, builder.plan.head_name)
            done(self.tied_modules)
        else:
            self.add_module("0", EmbeddingPipe(builder))
            done(self._item(0))
        for i in range(n):
            self.add_module(str(1 + i), DecoderLayerPipe(builder, i))
            done(self._item(1 + i))
        self.add_module(str(n + 1), EpiloguePipe(builder))
        done(self._item(n + 1))
        if not self._tied:
            self.add_module(str(n + 2), HeadPipe(builder))
            done(self._item(n + 2))
        self._num_items = n + 3
        self.loss_fn: Any = builder.loss
        """Called as loss_fn(logits, labels), looked up at every forward (the Trainer drop-in replaces it)."""

    def _item(self, index: int) -> nn.Module:
        return self._modules[str(index)]  # type: ignore[return-value]

    def forward(self, input_ids: object, labels: object) -> torch.Tensor:
        """`input_ids`: a tensor, or (input_ids, position_ids) for packed rows (dsx3d.models.packed).
        `labels`: a tensor, or (labels, norm) for masked rows (dsx3d.data.stream)."""
        last = self._num_items - 1
        x: Any = self.tied_modules[TIED_KEY](input_ids) if self._tied else self._item(0)(input_ids)
        for i in range(1, last):
            item = self._item(i)
            if self.activation_checkpointing and self.training and isinstance(item, DecoderLayerPipe):
                x = checkpoint(item, x, use_reentrant=False)
            else:
                x = item(x)
        logits = tied_head_forward(self.tied_modules[TIED_KEY], x) if self._tied else self._item(last)(x)  # type: ignore[arg-type]
        return self.loss_fn(logits, labels)


def build_sequential(
    config: PretrainedConfig,
    tp: TPContext,
    source: WeightSource,
    *,
    activation_checkpointing: bool = False,
    after_item: Callable[[nn.Module], None] | None = None,
    lora: LoraSpec | None = None,
    loss_tile_tokens: int = 0,
    cp: CPContext | None = None,
) -> SequentialLM:
    """This rank's whole model, TP-sharded over `tp` (whose group must be bound when tp.size > 1); with
    `lora`, frozen with peft adapters (dsx3d.models.lora)."""
    builder = LayerBuilder(config, resolve_family(config), tp, source, lora=lora, cp=cp)
    builder.loss_tile_tokens = loss_tile_tokens
    return SequentialLM(builder, activation_checkpointing=activation_checkpointing, after_item=after_item)
