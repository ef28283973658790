"""The pipeline layers: embedding prologue, decoder layers, epilogue (final norm) and the vocab-parallel head.

Between stages travels the tuple (hidden_states, input_ids): a float tensor that feeds the next stage's
graph, and the integer ids from which every stage recomputes the layer inputs (masks, rotary tables); packed
rows add their integer position_ids (`dsx3d.models.packed`). With
sequence parallelism hidden_states is this TP rank's (b, s/t, h) shard of the sequence; the recorded layer
calls (masks, rotary tables) stay whole-sequence, which is what the TP regions (attention) see. An MoE
family with an auxiliary loss appends the router logits of the layers so far (`dsx3d.models.moe`), from the
first stage that has a router on. With context parallelism (`dsx3d.distributed.context_parallel`)
hidden_states and input_ids are this CP rank's slice of the sequence and position_ids the whole sequence's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from dsx3d.distributed.context_parallel import CPContext
from dsx3d.distributed.expert_parallel.experts import ExpertContext, shard_experts
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from dsx3d.distributed.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    mark_sharded,
)
from dsx3d.distributed.tensor_parallel.mappings import all_reduce_grad_hook
from dsx3d.models import lora, moe, packed, tp_plan
from dsx3d.models.family_spec import FamilySpec
from dsx3d.models.lora import LoraSpec
from dsx3d.models.shape import dropout_probabilities
from dsx3d.models.skeleton import Skeleton, with_hidden
from dsx3d.models.tiled_loss import HeadInputs, head_inputs, tiled_loss_sum
from dsx3d.models.weights import WeightSource, materialize

log = logging.getLogger("dsx3d")


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


class LayerBuilder:
    """Per-process state shared by the layers of this rank's stage."""

    def __init__(
        self,
        config: PretrainedConfig,
        plan: FamilySpec,
        tp: TPContext,
        source: WeightSource,
        experts: ExpertContext | None = None,
        lora: LoraSpec | None = None,
        cp: CPContext | None = None,
    ):
        self.config, self.plan, self.tp, self.source = config, plan, tp, source
        self.cp = cp if cp is not None else CPContext()
        """Context parallelism: its group must be bound before layers are owned (Ulysses attention)."""
        self.experts = experts if experts is not None else ExpertContext(tp)
        self.lora = lora
        """With LoRA, every parameter read from the weights is frozen and decoder layers get peft adapters."""
        self.skeleton = Skeleton(config, plan)
        self.skeleton.lm.loss_function = moe.no_lm_loss  # the last stage computes the LM loss on vocab shards
        self.router_logits = moe.adds_auxiliary_loss(config, self.skeleton)
        """The family adds an auxiliary loss from router logits: they travel with the hidden states."""
        # dropout masks per TP region (dsx3d.distributed.tensor_parallel.random); a no-op without dropout
        tp.random.active = bool(dropout_probabilities(config))
        self.vocab = config.get_text_config().vocab_size
        self.padded_vocab = padded_vocab(self.vocab, tp.size)
        self.vocab_start = tp.chunk_bounds(self.padded_vocab)[0]
        self.base_prefix = f"{plan.base_prefix}."
        self.loss_tile_tokens = 0
        """train.loss_tile_tokens: N > 0 computes the logits and the loss N tokens at a time (`dsx3d.models.tiled_loss`)."""
        self.vocab_embedding: VocabParallelEmbedding | None = None
        self._scatter_embedding: bool | None = None
        if tp.sequence_parallel:
            reason = self.sequence_parallel_blocker()
            if reason is not None:
                tp.sequence_parallel = False
                log.warning("sequence parallelism is off for %s: %s", plan.model_type, reason)

    def sequence_parallel_blocker(self) -> str | None:
        """Why this model cannot run with sequence parallelism (`tp_plan.sequence_parallel_blocker`), or None."""
        return tp_plan.sequence_parallel_blocker(
            self.skeleton.layers, self.plan.layers_name, self.plan.tp_plan, lambda m: isinstance(m, nn.Linear)
        )

    # -- owning modules ------------------------------------------------------------------------------------

    def _shard(self, module: nn.Module, rel_name: str, on_sequence: bool = True) -> None:
        """Apply the family's TP plan to `module` (named `rel_name` relative to the base model), in place,
        as `dsx3d.models.tp_plan` decides for each submodule. Experts modules are split over TP and EP
        (`dsx3d.distributed.expert_parallel`), also at tp = 1 when ep > 1. `on_sequence`: the module runs on
        sequence shards under sequence parallelism (decoder layers, the epilogue; not the prologue)."""
        if not self.experts.splits:
            return
        shardings = tp_plan.plan_modules(module, rel_name, self.plan.tp_plan, lambda m: isinstance(m, nn.Linear))
        for sub_name, sub, sharding in shardings:
            if sharding.experts:
                shard_experts(sub, self.experts)
                continue
            if self.tp.size == 1:
                continue
            if sharding.grad_allreduce:
                sub._dsx3d_grad_allreduce = True  # hooked once its real parameters exist (_hook_replicated)
                continue
            if sharding.column:
                new: nn.Module = ColumnParallelLinear(sub, self.tp, gather_output=sharding.gather_output)
            else:
                new = RowParallelLinear(sub, self.tp, split_input=sharding.split_input)
            parent_name, _, attr = sub_name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attr, new)
        if self.tp.sequence_parallel and on_sequence:
            regions = tp_plan.region_modules(shardings)
            for name in regions:
                self.tp.region_module_hooks(module.get_submodule(name))
            for name, sub in module.named_modules():
                if not tp_plan.inside(name, regions) or isinstance(sub, RowParallelLinear):
                    sub._dsx3d_on_shards = True  # its own parameters see this rank's tokens only

    def _hook_replicated(self, module: nn.Module) -> None:
        """Full-weight params used on sharded heads (q/k norms) get partial grads: sum them over TP. With
        sequence parallelism so do the replicated params of modules that run on sequence shards (norms,
        biases added after a reduce-scatter): each rank's gradient covers its own tokens only."""
        hooked: set[int] = set()
        for sub in module.modules():
            whole = getattr(sub, "_dsx3d_grad_allreduce", False)
            if not (whole or getattr(sub, "_dsx3d_on_shards", False)):
                continue
            for p in sub.parameters(recurse=whole):
                if not p.requires_grad:  # frozen (LoRA): no gradient to reduce
                    continue
                if id(p) not in hooked and (whole or not getattr(p, "tensor_model_parallel", False)):
                    hooked.add(id(p))
                    p.register_hook(all_reduce_grad_hook(self.tp.group))

    def _own(self, module: nn.Module, rel_name: str, on_sequence: bool = True) -> nn.Module:
        self._shard(module, rel_name, on_sequence)
        materialize(module, f"{self.base_prefix}{rel_name}.", self.source, self.tp.rank)
        if self.lora is not None:
            lora.freeze(module)
            lora.inject(module, f"{self.base_prefix}{rel_name}.", self.lora, self.tp, self.source)
        self._hook_replicated(module)
        return module

    def own(self, rel_name: str, on_sequence: bool = True) -> nn.Module:
        """Take a base-model submodule, shard it, and read its weights."""
        return self._own(self.skeleton.submodule(rel_name), rel_name, on_sequence)

    def own_layer(self, index: int) -> nn.Module:
        layer = self._own(self.skeleton.layers[index], f"{self.plan.layers_name}.{index}")
        if self.cp.on:
            self.cp.install(layer, self.tp.size, self.skeleton.num_layers)
        return layer

    def own_embedding(self) -> nn.Module:
        embedding = self.skeleton.submodule(self.plan.embed_name)
        if self.tp.size > 1:
            self.vocab_embedding = VocabParallelEmbedding(embedding, self.tp, self.padded_vocab)  # type: ignore[arg-type]
        materialize(embedding, f"{self.base_prefix}{self.plan.embed_name}.", self.source, self.tp.rank)
        if self.lora is not None:
            lora.freeze(embedding)
        return embedding

    def prologue_extra_names(self) -> list[str]:
        """Other base-model modules with weights that run before the first layer (e.g. learned positions)."""
        skip = {self.plan.embed_name, self.plan.layers_name, *self.plan.epilogue_names}
        return [
            name
            for name, child in self.skeleton.base.named_children()
            if name not in skip and any(True for _ in child.parameters())
        ]

    def own_prologue_extras(self) -> list[nn.Module]:
        return [self.own(name, on_sequence=False) for name in self.prologue_extra_names()]

    def install_head(self, weight: nn.Parameter, bias: nn.Parameter | None = None) -> VocabParallelHead:
        head = VocabParallelHead(weight, self.tp, self.vocab_start, bias)
        setattr(self.skeleton.lm, self.plan.head_name, head)
        return head

    def head_params(self) -> tuple[nn.Parameter, nn.Parameter | None]:
        """The untied LM head's vocab-row shard (and its bias, if the family has one)."""
        holder = self._head_holder(weight=True)
        return holder._parameters["weight"], holder._parameters.get("bias")  # type: ignore[return-value]

    def head_bias(self) -> nn.Parameter | None:
        """A tied head's own bias shard, where the family's head has one (Phi): the weight is the embedding's."""
        return self._head_holder(weight=False)._parameters.get("bias")

    def _head_holder(self, weight: bool) -> nn.Module:
        meta = getattr(self.skeleton.lm, self.plan.head_name)
        rows = self.padded_vocab // self.tp.size
        holder = nn.Module()
        if weight:
            holder.register_parameter("weight", nn.Parameter(torch.empty(rows, meta.weight.shape[1], device="meta")))
        if getattr(meta, "bias", None) is not None:
            holder.register_parameter("bias", nn.Parameter(torch.empty(rows, device="meta")))
        if self.tp.size > 1:
            for p in holder.parameters():
                mark_sharded(p, 0)
        materialize(holder, f"{self.plan.head_name}.", self.source, self.tp.rank)
        if self.lora is not None:
            lora.freeze(holder)
        return holder

    def release_source(self) -> None:
        """Let the weight source drop what it has read so far (a fresh initialisation keeps each module it
        initialised until told); the parameters built from it are unaffected."""
        release = getattr(self.source, "release", None)
        if release is not None:
            release()

    # -- running -------------------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, training: bool, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states entering layer 0 (the base forward's prologue). With sequence parallelism, this
        rank's sequence shard: when the prologue after the lookup is token-wise (no learned positions, no
        extra modules), the embedding's partial lookups are reduce-scattered straight to the shard (half an
        all-reduce, as a row-parallel exit); otherwise the prologue runs on the whole replicated sequence and
        its output is cut (all-reduce plus an all-gather of the gradient)."""
        tp = self.tp
        with tp.item(training=training):
            if not tp.sequence_parallel:
                return self.skeleton.embed(input_ids, training=training, position_ids=position_ids)
            if self._scatter_embedding is None:
                self._scatter_embedding = not self.prologue_extra_names() and self.skeleton.prologue_is_tokenwise(
                    input_ids.shape[-1], tp.size
                )
            assert self.vocab_embedding is not None  # tp > 1
            self.vocab_embedding.scatter = self._scatter_embedding
            hidden = self.skeleton.embed(input_ids, training=training, position_ids=position_ids)
            return hidden if self._scatter_embedding else tp.scatter_sequence(hidden, training=training)

    def head(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, router_logits: torch.Tensor | None, training: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, HeadInputs]:
        """The last stage's logits (and, given router logits, the family's auxiliary loss terms); with
        `loss_tile_tokens`, the hidden states the loss computes them from, tile by tile (a tensor first: the
        engine hooks the item's output tensors). With cp > 1 the auxiliary loss sees every CP rank's tokens."""
        if router_logits is not None and self.cp.on:
            router_logits = self.cp.gather_tokens(router_logits)
        if self.loss_tile_tokens > 0:
            inputs = head_inputs(self, hidden, input_ids, router_logits, training)
            return inputs.hidden, inputs
        with self.tp.item(hidden, training=training):
            return self.skeleton.head(hidden, input_ids, router_logits)

    def loss(
        self,
        outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, HeadInputs],
        labels: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """HF's causal-LM loss on vocab shards: predict token t+1 at position t; plus the family's auxiliary
        terms when the head computed them (`outputs` = (logits, auxiliary)). `labels` alone: the mean over
        this micro-batch's non-ignored tokens. (labels, norm): the sum over them divided by norm, the global
        batch's count of tokens with loss per micro-batch slot (dsx3d.data.stream), so that DeepSpeed's
        average over micro-batches and DP ranks is the global per-token mean. `HeadInputs` (tiling): the
        same sum, computed a tile of tokens at a time."""
        labels, norm = labels if isinstance(labels, (tuple, list)) else (labels, None)
        if self.cp.on:  # this CP rank's slice of targets, shifted before the cut (dsx3d.data.context_parallel)
            target = labels.reshape(-1)
        else:
            target = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
        if isinstance(outputs, tuple) and isinstance(outputs[1], HeadInputs):
            total, extra = tiled_loss_sum(outputs[1], target), outputs[1].aux
        else:
            logits, extra = outputs if isinstance(outputs, tuple) else (outputs, None)
            assert isinstance(logits, torch.Tensor) and not isinstance(extra, HeadInputs)
            total = vocab_parallel_cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target, self.vocab_start, self.vocab, self.tp.group
            ).sum()
        if norm is not None:
            loss = total / norm.to(total.dtype).reshape(())
        else:
            loss = total / (target != IGNORE_INDEX).sum().clamp(min=1)
        return loss if extra is None else loss + extra


def embed_forward(builder: LayerBuilder, inputs: object, training: bool) -> tuple[torch.Tensor, ...]:
    """input_ids, or (input_ids, position_ids) for packed rows -> what travels to the first layer."""
    input_ids, positions = packed.split_inputs(inputs)
    hidden = builder.embed(input_ids, training, positions)
    if builder.cp.on:  # the slice's positions in, the whole sequence's out (the layers' masks need them)
        assert positions is not None, "context parallelism: micro-batches carry position_ids (dsx3d.data.context_parallel)"
        positions = builder.cp.gather_positions(positions)
    return packed.pack(hidden, input_ids, positions, None)


class EmbeddingPipe(nn.Module):
    """input_ids [or (input_ids, position_ids)] -> (hidden_states entering layer 0, input_ids[, position_ids])."""

    def __init__(self, builder: LayerBuilder):
        super().__init__()
        self.builder = [builder]  # a list keeps it out of nn.Module's registry
        self.embed = builder.own_embedding()
        self.extras = nn.ModuleList(builder.own_prologue_extras())

    def forward(self, inputs: object) -> tuple[torch.Tensor, ...]:
        return embed_forward(self.builder[0], inputs, self.training)


class DecoderLayerPipe(nn.Module):
    """One HF decoder layer, called exactly as the base model's forward would call it."""

    def __init__(self, builder: LayerBuilder, index: int):
        super().__init__()
        self.builder, self.index = [builder], index
        self.layer = builder.own_layer(index)
        name = f"{builder.plan.layers_name}.{index}"
        self.routers = moe.router_modules(builder.skeleton.base, self.layer, name) if builder.router_logits else []

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, input_ids, positions, carried = packed.unpack(inputs)
        builder = self.builder[0]
        if builder.cp.on:  # masks for the whole sequence, rotary tables for this rank's slice
            assert positions is not None
            args, kwargs = builder.skeleton.layer_calls(positions, hidden.dtype, positions)[self.index]
            call = (args, builder.cp.local_call(kwargs, positions.shape[-1]))
        else:
            call = builder.skeleton.layer_calls(input_ids, hidden.dtype, positions)[self.index]
        args, kwargs = with_hidden(call, hidden)
        with builder.tp.item(hidden, training=self.training):  # no region open at either end
            with moe.capture_router_logits(self.routers) as router_logits:
                out = self.layer(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        logits = moe.append_router_logits(carried, router_logits)
        return packed.pack(hidden, input_ids, positions, logits)


class EpiloguePipe(nn.Module):
    """The base model's modules after the last layer (the final norm)."""

    def __init__(self, builder: LayerBuilder):
        super().__init__()
        self.builder = [builder]
        self.mods = nn.ModuleList(builder.own(name) for name in builder.plan.epilogue_names)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, *rest = inputs
        with self.builder[0].tp.item(hidden, training=self.training):
            for mod in self.mods:
                hidden = mod(hidden)
        return (hidden, *rest)


class HeadPipe(nn.Module):
    """Untied LM head: (hidden, ids) -> vocab-sharded logits (b, s, V_padded / tp)."""

    def __init__(self, builder: LayerBuilder):
        super().__init__()
        self.builder = [builder]
        self.lm_head = builder.install_head(*builder.head_params())

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        hidden, input_ids, _, router = packed.unpack(inputs)
        return self.builder[0].head(hidden, input_ids, router, training=self.training)


class TiedEmbeddingPipe(nn.Module):
    """The embedding shard shared by the first stage (lookup) and the last (LM head), via TiedLayerSpec;
    with tp > 1 each rank ties its own vocab shard."""

    def __init__(self, builder: LayerBuilder, on_first_stage: bool, on_last_stage: bool):
        super().__init__()
        self.builder = [builder]
        self.embed = builder.own_embedding()
        self.extras = nn.ModuleList(builder.own_prologue_extras() if on_first_stage else [])
        self.head_bias = builder.head_bias() if on_last_stage else None
        if on_last_stage:
            builder.install_head(self.embed.weight, self.head_bias)  # type: ignore[arg-type]

    def forward(self, inputs: object) -> tuple[torch.Tensor, ...]:
        return embed_forward(self.builder[0], inputs, self.training)


def tied_head_forward(module: TiedEmbeddingPipe, inputs: Any) -> Any:
    hidden, input_ids, _, router = packed.unpack(inputs)
    return module.builder[0].head(hidden, input_ids, router, training=module.training)
