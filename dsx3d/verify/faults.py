"""Deliberate defects in the parallel engine, to show that `dsx3d verify` catches each one.

Each fault is a context manager that patches dsx3d's (or DeepSpeed's) code in this process; the fork harness
starts the ranks inside it, so they inherit the broken code, while the single-process HF reference never
runs it. `FAULTS` maps a name to (what breaks, the layout that exercises it, the model, the patch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig

from dsx3d.boundary_types import PipeEngine
from dsx3d.models.known_families import tiny_config

if TYPE_CHECKING:
    from dsx3d.distributed.expert_parallel.experts import ExpertContext
    from dsx3d.distributed.tensor_parallel.context import TPContext
    from dsx3d.distributed.tensor_parallel.regions import RegionEntry
    from dsx3d.models.pipe_layers import DecoderLayerPipe, LayerBuilder


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    own = not isinstance(owner, type) or name in vars(owner)  # else inherited: delete the patch afterwards
    original = (vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)) if own else None
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def no_column_input_grad_allreduce() -> contextlib.AbstractContextManager[None]:
    """Column-parallel linears forget Megatron's f: the summed input gradient of a TP region entry is never
    reduced over TP (with sequence parallelism each rank keeps its own rows of its partial sum)."""
    from dsx3d.distributed.tensor_parallel import regions
    from dsx3d.distributed.tensor_parallel.mappings import own_rows

    class _Done:
        def wait(self) -> None:
            pass

    def launch(self: RegionEntry) -> None:
        assert self._partial is not None
        buf = own_rows(self._partial, self.group).movedim(-2, 0) if self.gather else self._partial
        self._partial = None
        self._launched = (buf, _Done())

    return _patched(regions.RegionEntry, "_launch", launch)


def no_row_output_allreduce() -> contextlib.AbstractContextManager[None]:
    """Row-parallel linears forget Megatron's g: each rank keeps its partial sum (with sequence parallelism,
    its own rows of it)."""
    from dsx3d.distributed.tensor_parallel.context import TPContext
    from dsx3d.distributed.tensor_parallel.mappings import split_to_sequence

    def exit_region(self: TPContext, y: torch.Tensor, *, training: bool = False, scatter: bool | None = None) -> torch.Tensor:
        if scatter is None:
            scatter = self.sequence_parallel and self.depth <= 1
        if scatter and self.size > 1:
            out = split_to_sequence(y, self.group)
            self.random.enter_sharded(out, training)
            return out
        self.random.leave_sharded()
        return y

    return _patched(TPContext, "exit_region", exit_region)


def no_tied_grad_reduction() -> contextlib.AbstractContextManager[None]:
    """The tied embedding / LM head gradients of the first and last stage are never summed."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    def reduce_tied_grads(self: PipeEngine) -> None:  # DeepSpeed's, without the all-reduce of the tied gradients
        if self.zero_optimization_partition_gradients():
            self.optimizer.overlapping_partition_gradients_reduce_epilogue()

    # the engine dispatches schedule instructions through a class-level table of functions
    table = {**PipelineEngine._INSTRUCTION_MAP, schedule.ReduceTiedGrads: reduce_tied_grads}
    return _patched(PipelineEngine, "_INSTRUCTION_MAP", table)


def vocab_shard_offset() -> contextlib.AbstractContextManager[None]:
    """The loss reads each rank's vocabulary shard one column off."""
    from dsx3d.models.pipe_layers import LayerBuilder

    original = LayerBuilder.__init__

    def init(self: LayerBuilder, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.vocab_start += 1

    return _patched(LayerBuilder, "__init__", init)


def layer_skipped_at_stage_boundary() -> contextlib.AbstractContextManager[None]:
    """The first decoder layer of the second stage passes its input through."""
    from dsx3d.models.pipe_layers import DecoderLayerPipe

    original = DecoderLayerPipe.forward

    def forward(self: DecoderLayerPipe, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        module: Any = self.builder[0]  # carries the test's mark
        if getattr(module, "_fault_first_index", None) is None:
            module._fault_first_index = self.index  # the first layer this rank runs
        if self.index == module._fault_first_index and self.index > 0:
            return inputs
        return original(self, inputs)

    return _patched(DecoderLayerPipe, "forward", forward)


def replicated_grad_counted_tp_times() -> contextlib.AbstractContextManager[None]:
    """Norm weights (whole on every TP rank) are marked as sharded, so the global gradient norm counts them
    once per TP rank and clipping scales every gradient wrongly."""
    from dsx3d.models.pipe_layers import LayerBuilder

    original = LayerBuilder._own

    def own(self: LayerBuilder, module: torch.nn.Module, rel_name: str, *args: Any) -> torch.nn.Module:
        out = original(self, module, rel_name, *args)
        for name, p in out.named_parameters():
            if "norm" in name and not getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel = True  # type: ignore[attr-defined]
        return out

    return _patched(LayerBuilder, "_own", own)


def loss_over_wrong_micro_batch_count() -> contextlib.AbstractContextManager[None]:
    """The loss of each micro-batch is divided by one micro-batch too many before the backward."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    def scale(self: PipeEngine, prescaled_loss: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return prescaled_loss / (self.gradient_accumulation_steps() + 1)

    return _patched(PipelineEngine, "_scale_loss_by_gas", scale)


def no_qk_norm_grad_allreduce() -> contextlib.AbstractContextManager[None]:
    """q/k norms (replicated_with_grad_allreduce) keep only their own heads' gradient contribution."""
    import dsx3d.models.pipe_layers as pipe_layers

    return _patched(pipe_layers, "all_reduce_grad_hook", lambda group: lambda g: g)


def experts_reduced_over_all_dp_ranks() -> contextlib.AbstractContextManager[None]:
    """Expert shards lack DeepSpeed's expert marks: their gradients are averaged over the whole DP group, so
    each EP rank's experts are mixed with the other EP ranks' (different) experts."""
    from dataclasses import replace

    from dsx3d.distributed.expert_parallel import experts

    original = experts.mark_expert_shard

    def mark(param: torch.nn.Parameter, slot: int, ctx: ExpertContext) -> None:
        original(param, slot, replace(ctx, ep=1))

    return _patched(experts, "mark_expert_shard", mark)


def routing_weight_grad_not_summed_over_tp() -> contextlib.AbstractContextManager[None]:
    """The experts region enters the hidden states but not the routing weights: the router's gradient keeps
    only this TP rank's experts' share."""
    from dsx3d.distributed.expert_parallel.experts import _ExpertsRegion

    def enter(self: _ExpertsRegion, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ctx.tp.enter_partial(x, training=self.module_ref[0].training), w

    return _patched(_ExpertsRegion, "enter", enter)


def aux_loss_lost_between_stages() -> contextlib.AbstractContextManager[None]:
    """Router logits do not travel between stages, so the last stage computes no auxiliary loss."""
    from dsx3d.models import moe

    return _patched(moe, "adds_auxiliary_loss", lambda config, skeleton: False)


@dataclass(frozen=True)
class Fault:
    description: str
    layout: tuple[int, int, int]
    """(dp, tp, pp) where the defect matters."""
    config: Callable[[], PretrainedConfig]
    patch: Callable[[], contextlib.AbstractContextManager[None]]
    ep: int = 1
    bf16_config: Callable[[], PretrainedConfig] | None = None
    """The model in bf16, where `config`'s would hide the defect below what bf16 itself changes."""

    def config_for(self, dtype: str) -> PretrainedConfig:
        return (self.bf16_config or self.config)() if dtype == "bf16" else self.config()


def _llama() -> PretrainedConfig:
    return tiny_config("llama", tie_word_embeddings=False)


def _moe() -> PretrainedConfig:
    """Mixtral: top-2 of 8 experts, fused 3D expert weights, with its load-balancing loss."""
    return tiny_config("mixtral", num_local_experts=8, output_router_logits=True)


def _moe_every_expert() -> PretrainedConfig:
    """Mixtral routing every token to both of its 2 experts: no top-k choice for bf16 to leave undecided.
    On `_moe` in bf16 about half of the token choices lie within bf16's round-off of the router's scores
    (dsx3d.verify.topk_ties: a tiny router's probabilities are nearly uniform), and the correct run differs
    from fp32 by what those flips change; the router's own gradient, which the routing defect halves, is the
    quantity they move most."""
    return tiny_config("mixtral", num_local_experts=2, num_experts_per_tok=2, output_router_logits=True)


FAULTS: dict[str, Fault] = {
    "column-parallel input gradient not all-reduced": Fault(
        "no f: q/k/v, gate/up input gradients are partial sums", (1, 2, 1), _llama, no_column_input_grad_allreduce
    ),
    "row-parallel output not all-reduced": Fault(
        "no g: o_proj/down_proj outputs are partial sums", (1, 2, 1), _llama, no_row_output_allreduce
    ),
    "tied weight gradient not reduced": Fault(
        "first and last stage update their copies of the tied embedding apart",
        (1, 1, 2),
        lambda: tiny_config("qwen3", tie_word_embeddings=True),
        no_tied_grad_reduction,
    ),
    "vocab shard offset by one": Fault(
        "the vocab-parallel loss looks up targets one column off", (1, 2, 1), _llama, vocab_shard_offset
    ),
    "layer skipped at a stage boundary": Fault(
        "the second stage skips its first decoder layer", (1, 1, 2), _llama, layer_skipped_at_stage_boundary
    ),
    "replicated gradient counted tp times in the norm": Fault(
        "norm weights counted on every TP rank in the clipping norm", (1, 2, 1), _llama, replicated_grad_counted_tp_times
    ),
    "loss averaged over the wrong number of micro-batches": Fault(
        "each micro-batch loss divided by m + 1", (1, 1, 2), _llama, loss_over_wrong_micro_batch_count
    ),
    "q/k norm gradient not all-reduced": Fault(
        "replicated_with_grad_allreduce ignored", (1, 2, 1), lambda: tiny_config("qwen3"), no_qk_norm_grad_allreduce
    ),
    "expert gradients reduced over every DP rank": Fault(
        "experts of different EP ranks averaged together",
        (2, 1, 2),
        _moe,
        experts_reduced_over_all_dp_ranks,
        ep=2,
        bf16_config=_moe_every_expert,
    ),
    "routing-weight gradient not summed over TP": Fault(
        "the router learns from one TP rank's experts only",
        (1, 2, 1),
        _moe,
        routing_weight_grad_not_summed_over_tp,
        bf16_config=_moe_every_expert,
    ),
    "auxiliary loss lost between stages": Fault(
        "the load-balancing loss is left out when the layers span stages",
        (1, 1, 2),
        _moe,
        aux_loss_lost_between_stages,
        bf16_config=_moe_every_expert,
    ),
}
