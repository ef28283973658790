"""Deliberate defects in the parallel engine, to show that `dsx3d verify` catches each one.

Each fault is a context manager that patches dsx3d's (or DeepSpeed's) code in this process; the fork harness
starts the ranks inside it, so they inherit the broken code, while the single-process HF reference never
runs it. `FAULTS` maps a name to (what breaks, the layout that exercises it, the model, the patch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from dsx3d.models.families import tiny_config


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
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
    """Column-parallel linears forget Megatron's f: their input gradient is never summed over TP."""
    from dsx3d.distributed.tensor_parallel.context import TPContext

    def enter_region(self: Any, x: torch.Tensor, *, training: bool) -> torch.Tensor:
        self.random.enter_sharded(x, training)
        return x

    return _patched(TPContext, "enter_region", enter_region)


def no_row_output_allreduce() -> contextlib.AbstractContextManager[None]:
    """Row-parallel linears forget Megatron's g: each rank keeps its partial sum."""
    from dsx3d.distributed.tensor_parallel.context import TPContext

    def exit_region(self: Any, y: torch.Tensor) -> torch.Tensor:
        self.random.leave_sharded()
        return y

    return _patched(TPContext, "exit_region", exit_region)


def no_tied_grad_reduction() -> contextlib.AbstractContextManager[None]:
    """The tied embedding / LM head gradients of the first and last stage are never summed."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    def reduce_tied_grads(self: Any) -> None:  # DeepSpeed's, without the all-reduce of the tied gradients
        if self.zero_optimization_partition_gradients():
            self.optimizer.overlapping_partition_gradients_reduce_epilogue()

    # the engine dispatches schedule instructions through a class-level table of functions
    table = {**PipelineEngine._INSTRUCTION_MAP, schedule.ReduceTiedGrads: reduce_tied_grads}
    return _patched(PipelineEngine, "_INSTRUCTION_MAP", table)


def vocab_shard_offset() -> contextlib.AbstractContextManager[None]:
    """The loss reads each rank's vocabulary shard one column off."""
    from dsx3d.models.pipe_layers import LayerBuilder

    original = LayerBuilder.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.vocab_start += 1

    return _patched(LayerBuilder, "__init__", init)


def layer_skipped_at_stage_boundary() -> contextlib.AbstractContextManager[None]:
    """The first decoder layer of the second stage passes its input through."""
    from dsx3d.models.pipe_layers import DecoderLayerPipe

    original = DecoderLayerPipe.forward

    def forward(self: Any, inputs: Any) -> Any:
        module = self.builder[0]
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

    def own(self: Any, module: torch.nn.Module, rel_name: str) -> torch.nn.Module:
        out = original(self, module, rel_name)
        for name, p in out.named_parameters():
            if "norm" in name and not getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel = True  # type: ignore[attr-defined]
        return out

    return _patched(LayerBuilder, "_own", own)


def loss_over_wrong_micro_batch_count() -> contextlib.AbstractContextManager[None]:
    """The loss of each micro-batch is divided by one micro-batch too many before the backward."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    def scale(self: Any, prescaled_loss: Any, **kwargs: Any) -> Any:
        return prescaled_loss / (self.gradient_accumulation_steps() + 1)

    return _patched(PipelineEngine, "_scale_loss_by_gas", scale)


def no_qk_norm_grad_allreduce() -> contextlib.AbstractContextManager[None]:
    """q/k norms (replicated_with_grad_allreduce) keep only their own heads' gradient contribution."""
    import dsx3d.models.pipe_layers as pipe_layers

    return _patched(pipe_layers, "all_reduce_grad_hook", lambda group: lambda g: g)


@dataclass(frozen=True)
class Fault:
    description: str
    layout: tuple[int, int, int]
    """(dp, tp, pp) where the defect matters."""
    config: Callable[[], PretrainedConfig]
    patch: Callable[[], contextlib.AbstractContextManager[None]]


def _llama() -> PretrainedConfig:
    return tiny_config("llama", tie_word_embeddings=False)


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
}
