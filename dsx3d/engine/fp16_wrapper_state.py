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

from dsx3d.boundary_types import DSEngine


def wrapper_masters(optimizer: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(low-precision parameter, its fp32 copy) for every parameter of DeepSpeed's fp16 wrappers:
    FP16_UnfusedOptimizer keeps one copy per parameter (`fp32_groups`), FP16_Optimizer one flat tensor per
    group (`fp32_groups_flat`, cut here into views per parameter). Empty for the other optimizers."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from torch._utils import _unflatten_dense_tensors

    if isinstance(optimizer, FP16_Optimizer):
        copies = [
            _unflatten_dense_tensors(flat, group)
            for flat, group in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups, strict=True)
        ]
    elif isinstance(optimizer, FP16_UnfusedOptimizer):
        copies = optimizer.fp32_groups
    else:
        return []
    return [
        (p, m) for group, masters in zip(optimizer.fp16_groups, copies, strict=True) for p, m in zip(group, masters, strict=True)
    ]


def undo_initialising_step(engine: DSEngine) -> None:
    """Reset the optimizer state and fp32 masters of `engine`'s fp16 wrapper to what they were before its
    constructor's zero-gradient step (nothing for the other optimizers)."""
    pairs = wrapper_masters(engine.optimizer)
    if not pairs:
        return
    inner = engine.optimizer.optimizer
    inner.state.clear()
    for group in inner.param_groups:
        if "step" in group:  # DeepSpeed's FusedAdam also keeps a count per group
            group["step"] = 0
    with torch.no_grad():
        for low, master in pairs:
            master.copy_(low)
