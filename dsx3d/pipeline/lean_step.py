"""Per-step work DeepSpeed's PipelineEngine does that a pipeline step does not need, removed (`trim_engine`):
ZeRO-1's bookkeeping hooks, a gradient reduction over one rank without ZeRO, and ZeRO-1's copies of each gradient
through buckets over one rank. Each only where it provably changes nothing; everywhere else the engine is left as DeepSpeed built it.

Measured against torch.distributed.pipelining's Schedule1F1B on the same model (scripts/bench/pipeline_peer.py,
docs/guide/pipeline-schedules.md): with ZeRO stage 1, DeepSpeed's `DeepSpeedZeroOptimizer` registers a hook
on every parameter's gradient accumulation (`create_gradient_handling_hooks`, zero/stage_1_and_2.py) that runs
once per parameter per micro-batch's backward. Under ZeRO-1 without `overlap_comm`, CPU offload or a separate
gradient-accumulation attribute, the hook only does bookkeeping: `process_gradients` returns after allocating
(unused) bucket buffers, and its epilogue count walks the autograd graph
(`count_used_parameters_in_backward`) for nothing, because the pipeline engine reduces `.grad` itself at its
`ReduceGrads` instruction (`reduce_gradients(pipeline_parallel=True)` allocates its own buckets). That was
about 5% of a step's CPU time on a small Llama at pp 2. `trim_engine` removes those hooks where that is
provably all they do; anything else keeps them.

Without ZeRO, `ReduceGrads` runs DeepSpeed's `buffered_allreduce_fallback`: it flattens every gradient into one
buffer, all-reduces it over the data-parallel group and copies it back. Over a group of one rank, in fp32,
without a predivide factor or experts (dsx3d's embeddings give dense gradients), each of those steps returns its
input unchanged (`allreduce_bucket`, runtime/engine.py: no cast, no multiply, an all-reduce over one rank); it
took 3-5 ms per step on the first stage of the peer benchmark's Llama. `trim_engine` makes it a no-op there
(`reduction_is_identity`).

With ZeRO-1 over a data-parallel group of one rank, `reduce_gradients` copies each gradient into a bucket,
all-reduces the bucket over that one rank, divides it by 1 and copies it again into a partition buffer; then its
epilogue builds the flat partition the optimizer steps on from the gradients. In fp32, without a predivide
factor, experts, Ulysses or AutoEP folding, everything before the epilogue only moves gradients: `trim_engine`
runs the epilogue alone there (`zero1_reduction_moves_only`). On the peer benchmark's Llama (p 2, m 8) that cut
`ReduceGrads` from 9.3 to 0.2 ms on the first stage, and the updated weights were equal bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from dsx3d.boundary_types import PipeEngine


def plain_zero1(optimizer: Any) -> bool:
    """Whether `optimizer` is DeepSpeed's ZeRO-1 and nothing more: a `DeepSpeedZeroOptimizer` that neither
    partitions gradients (stage 2), overlaps their reduction, offloads to the CPU, accumulates into a separate
    attribute nor runs ZenFlow."""
    flags = ("partition_gradients", "overlap_comm", "cpu_offload", "use_grad_accum_attribute", "zenflow")
    return type(optimizer).__name__ == "DeepSpeedZeroOptimizer" and not any(getattr(optimizer, f, False) for f in flags)


def bookkeeping_only_hooks(optimizer: Any) -> bool:
    """Whether `optimizer`'s gradient hooks are ZeRO-1's bookkeeping, nothing the step reads (`plain_zero1`)."""
    return plain_zero1(optimizer) and bool(getattr(optimizer, "_grad_acc_hooks", None))


def _one_fp32_rank(engine: PipeEngine) -> bool:
    """fp32 gradients communicated in fp32, no predivide factor, no experts, and a data-parallel group of one
    rank: the reduction's casts, scalings and all-reduce each return their input."""
    return (
        not engine.bfloat16_enabled()
        and not engine.fp16_enabled()
        and engine.communication_data_type == torch.float32
        and engine.gradient_predivide_factor() == 1.0
        and not engine.has_moe_layers
        and engine.mpu.get_data_parallel_world_size() == 1  # the grid's size of the group the reduction uses
    )


def reduction_is_identity(engine: PipeEngine) -> bool:
    """Whether `engine`'s gradient reduction at `ReduceGrads` returns every gradient bit for bit as it was: no
    ZeRO, over one fp32 rank (`_one_fp32_rank`)."""
    return engine.zero_optimization_stage() == 0 and _one_fp32_rank(engine)


def zero1_reduction_moves_only(engine: PipeEngine) -> bool:
    """Whether ZeRO-1's `reduce_gradients` before its epilogue only moves gradients between buffers: plain ZeRO-1
    over one fp32 rank, without Ulysses (its division by the sequence-parallel size), AutoEP's TP folding or
    Muon."""
    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None)
    return (
        engine.zero_optimization_stage() == 1
        and plain_zero1(optimizer)
        and _one_fp32_rank(engine)
        and getattr(optimizer, "sequence_parallel_size", 1) == 1
        and getattr(optimizer, "autoep_folding_tp_group", None) is None
        and "muon" not in type(inner).__name__.lower()
    )


def skip_identity_reduction(engine: PipeEngine) -> bool:
    """Make `engine`'s data-parallel gradient reduction a no-op where it is an identity; returns whether it did."""
    if not reduction_is_identity(engine):
        return False

    def nothing_to_reduce(grads: object = None, elements_per_buffer: int = 0) -> None:
        return None

    engine.buffered_allreduce_fallback = nothing_to_reduce  # type: ignore[method-assign]
    return True


def reduce_by_epilogue_only(engine: PipeEngine) -> bool:
    """Make ZeRO-1's `reduce_gradients` run its epilogue alone where the rest only moves gradients; returns
    whether it did. The epilogue's own bucket pass (`reduce_ipg_grads`) is skipped too: nothing was put in a
    bucket."""
    if not zero1_reduction_moves_only(engine):
        return False
    optimizer = engine.optimizer

    def no_buckets(comm_dtype: object = None) -> None:
        return None

    def epilogue_only(pipeline_parallel: bool = False) -> None:
        optimizer.reduce_ipg_grads = no_buckets
        try:
            optimizer.independent_gradient_partition_epilogue()
        finally:
            del optimizer.reduce_ipg_grads

    optimizer.reduce_gradients = epilogue_only
    return True


def trim_engine(engine: PipeEngine) -> int:
    """Remove ZeRO-1's bookkeeping gradient hooks from a pipeline engine, its data-parallel reduction where that
    is an identity, and ZeRO-1's bucket pass where it only moves gradients; returns how many hooks were removed."""
    skip_identity_reduction(engine)
    reduce_by_epilogue_only(engine)
    optimizer = getattr(engine, "optimizer", None)
    if not bookkeeping_only_hooks(optimizer):
        return 0
    hooks = optimizer._grad_acc_hooks  # type: ignore[union-attr]
    for handle in hooks:
        handle.remove()
    removed = len(hooks)
    hooks.clear()
    return removed
