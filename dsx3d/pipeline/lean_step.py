"""Per-step work DeepSpeed's PipelineEngine does that a pipeline step does not need, removed (`trim_engine`).

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
"""

from __future__ import annotations

from typing import Any

from dsx3d.boundary_types import PipeEngine


def bookkeeping_only_hooks(optimizer: Any) -> bool:
    """Whether `optimizer`'s gradient hooks are ZeRO-1's bookkeeping, nothing the step reads: a
    `DeepSpeedZeroOptimizer` that neither partitions gradients (stage 2), overlaps their reduction, offloads
    to the CPU, accumulates into a separate attribute nor runs ZenFlow."""
    if type(optimizer).__name__ != "DeepSpeedZeroOptimizer" or not getattr(optimizer, "_grad_acc_hooks", None):
        return False
    flags = ("partition_gradients", "overlap_comm", "cpu_offload", "use_grad_accum_attribute", "zenflow")
    return not any(getattr(optimizer, flag, False) for flag in flags)


def trim_engine(engine: PipeEngine) -> int:
    """Remove ZeRO-1's bookkeeping gradient hooks from a pipeline engine; returns how many were removed."""
    optimizer = getattr(engine, "optimizer", None)
    if not bookkeeping_only_hooks(optimizer):
        return 0
    hooks = optimizer._grad_acc_hooks  # type: ignore[union-attr]
    for handle in hooks:
        handle.remove()
    removed = len(hooks)
    hooks.clear()
    return removed
