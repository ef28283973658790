"""DeepSpeed's bf16 optimizer on a rank that adds nothing to the global gradient norm.

`BF16_Optimizer.step` (bf16, and bf16 with ZeRO-1 and fp32 gradient accumulation) computes the global norm
from `get_grads_for_norm()`: this rank's gradients that count once in the whole model, i.e. without the
replicated parameters on TP ranks other than 0 and without a tied copy on a later stage
(`ds_pipe_replicated`). It then stacks their norms, which fails on an empty list ("stack expects a
non-empty TensorList") before the all-reduce over the model-parallel group that every rank must join.

A pipeline stage without decoder layers gets such a rank: with tied embeddings the last stage holds only
the final norm (replicated over TP) and the tied head (a copy of the first stage's embedding), so its TP
ranks other than 0 count nothing. Its correct contribution to the sum of squares is zero;
`count_empty_as_zero` makes it so (a zero tensor instead of no tensor), and every rank then joins the same
all-reduce. fp32 runs do not use this optimizer (ZeRO-1 has its own norm; ZeRO-0 clips with
dsx3d.distributed.grad_clip, which sums into a zero tensor already).
"""

from __future__ import annotations

from typing import Any

import torch

from dsx3d.boundary_types import DSEngine


def count_empty_as_zero(engine: DSEngine) -> None:
    """Make `engine`'s BF16_Optimizer count a rank without norm-counted gradients as a zero norm."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    optimizer = engine.optimizer
    if not isinstance(optimizer, BF16_Optimizer):
        return
    original = optimizer.get_grads_for_norm
    device = engine.device

    def get_grads_for_norm(for_clipping: bool = False) -> Any:
        grads = original(for_clipping=for_clipping)
        if for_clipping:
            return grads  # every local gradient, scaled in place: an empty list is fine there
        non_expert, expert = grads
        if not non_expert:
            non_expert = [torch.zeros(1, dtype=torch.float32, device=device)]
        return non_expert, expert

    optimizer.get_grads_for_norm = get_grads_for_norm
