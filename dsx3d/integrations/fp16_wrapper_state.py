"""Undo the optimizer step that DeepSpeed's fp16 wrappers take while they are built.

Without ZeRO, DeepSpeed drives a low-precision model through FP16_UnfusedOptimizer or FP16_Optimizer (fp16,
and bf16 on the regular engine: `dsx3d.recipe.ds_optimizer`, "ddp_bf16"). Their constructors call
`initialize_optimizer_states`, which sets every fp32 master's gradient to zeros and runs the inner optimizer's
`step()` once, to create its state. For AdamW that step is not free: it counts (step = 1, with zero moments)
and applies the weight decay (each master times 1 - lr wd). Every real step then runs one count ahead, and
Adam's bias correction with it: the first real step moves an element with a solid gradient by
(0.1 / 0.19) / sqrt(0.05 / 0.0975) = 0.735 lr instead of lr (betas 0.9, 0.95), and the next steps differ too,
less and less. HF's AdamW, and DeepSpeed's own BF16_Optimizer and ZeRO optimizers, create the state lazily
at the first real step.

`undo_initialising_step` forgets that state (the inner optimizer creates it again at the first real step,
as the others do) and copies the low-precision parameters, from which the wrapper made its masters and
which the dummy step did not touch, back into the masters.
"""

from __future__ import annotations

import torch

from dsx3d.integrations.boundary_types import DSEngine


def undo_initialising_step(engine: DSEngine) -> None:
    """Reset the optimizer state and fp32 masters of `engine`'s fp16 wrapper to what they were before its
    constructor's zero-gradient step (nothing for the other optimizers)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    optimizer = engine.optimizer
    if not isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return
    inner = optimizer.optimizer
    inner.state.clear()
    for group in inner.param_groups:
        if "step" in group:  # DeepSpeed's FusedAdam also keeps a count per group
            group["step"] = 0
    with torch.no_grad():
        if isinstance(optimizer, FP16_Optimizer):
            for master, low in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups_flat, strict=True):
                master.copy_(low)
        else:
            for masters, lows in zip(optimizer.fp32_groups, optimizer.fp16_groups, strict=True):
                for master, low in zip(masters, lows, strict=True):
                    master.copy_(low)
