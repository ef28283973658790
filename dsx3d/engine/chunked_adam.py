"""torch's Adam over a large CPU tensor stepped in pieces of `PIECE` elements: the same arithmetic on each
element, without the allocator's page faults.

DeepSpeed's ZeRO-1 and ZeRO-2 (and its bf16 optimizer) hand the optimizer one flat fp32 partition per
parameter group: on the first stage of the peer benchmark's Llama (scripts/bench/pipeline_peer.py) one
tensor of 2.15M values. torch's single-tensor Adam (`_single_tensor_adam`, the path it takes on the CPU) makes
whole-tensor temporaries on every step (the square root of the second moment, its division by the bias
correction), 8.6 MB each. glibc serves an allocation that large with `mmap` and returns it with `munmap` on
free; its dynamic threshold only moves to the size just freed, and a request of exactly that size is still
`>=` the threshold, so every step maps those temporaries afresh and faults in each of their 4 KiB pages:
about 5,000 minor faults a step on that rank. cProfile put 16.5 ms a step in that Adam; torch's `AdamW.step`
over the same values held in 46 separate tensors took 9 ms (timed).

Adam is elementwise: each value of the parameter, gradient and both moments is updated from its own values
and the shared step count. `step_in_pieces` makes the optimizer's `_init_group` hand Adam views of `PIECE`
elements of each large CPU tensor instead of the whole; the first view of a tensor carries the tensor's own
step counter (Adam adds one to it once) and the others a copy of it (their additions are dropped), so the
state keeps its tensors and its step, and checkpoints are unchanged. `PIECE` is a multiple of every CPU
vector width, so each value takes the same vector or scalar kernel path as in the whole tensor: the weights
and moments equal Adam's over the whole tensor bit for bit (tests/unit/test_chunked_adam.py, with one thread
and with two, amsgrad too; tests/distributed/test_chunked_adam_engine.py on ZeRO-1, ZeRO-2 and bf16 engines).

The engine builder applies it to the torch optimizer inside DeepSpeed's optimizer wrappers, the one that
steps flat partitions (`step_engine_in_pieces`); without a wrapper (ZeRO-0 in fp32) Adam steps the model's
own tensors as torch does and is left alone. Only where torch takes the single-tensor path and a tensor is on
the CPU and contiguous: `foreach`, `fused`, `capturable` and `differentiable` groups are left as they are,
and so is every GPU tensor (the caching allocator has no such cost there, and pieces would only add kernel
launches). On the peer benchmark's first stage in a process of its own (p 2, m 8, ZeRO-1, 12 steps, twice
each way), `OptimizerStep` went from 25.1 and 25.5 ms with about 5,000 faults a step to 18.2 and 17.6 ms
with 2; the weights were equal bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

PIECE = 1 << 16
"""Elements per piece: 256 KiB of fp32, so Adam's temporaries stay small and in cache."""


def _single_tensor(group: dict[str, Any]) -> bool:
    return not any(group.get(k) for k in ("foreach", "fused", "capturable", "differentiable"))


def step_in_pieces(optimizer: Any, piece: int | None = None) -> bool:
    """Make torch's Adam (or AdamW) `optimizer` step each CPU tensor of more than `piece` elements (default
    `PIECE`) in views of `piece` (module docstring); returns whether it did. Any other optimizer, and one
    already stepping in pieces, is left alone."""
    if not isinstance(optimizer, torch.optim.Adam) or getattr(optimizer, "_dsx3d_pieces", None):
        return False
    piece = piece or PIECE
    original = optimizer._init_group

    def _init_group(group: dict[str, Any], params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
                    max_exp_avg_sqs: list, state_steps: list) -> bool:
        has_complex = original(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        if has_complex or not _single_tensor(group):
            return has_complex
        lists = [params, grads, exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if group["amsgrad"] else [])
        pieces: list[list[torch.Tensor]] = [[] for _ in lists]
        steps: list[torch.Tensor] = []
        for i, step in enumerate(state_steps):
            tensors = [values[i] for values in lists]
            whole = tensors[0]
            if whole.device.type != "cpu" or whole.numel() <= piece or not all(t.is_contiguous() for t in tensors):
                for out, t in zip(pieces, tensors, strict=True):
                    out.append(t)
                steps.append(step)
                continue
            views = [t.view(-1).split(piece) for t in tensors]
            for j in range(len(views[0])):
                for out, v in zip(pieces, views, strict=True):
                    out.append(v[j])
                steps.append(step if j == 0 else step.clone())  # Adam adds one to each; the copies are dropped
        for values, out in zip(lists, pieces, strict=True):
            values[:] = out
        state_steps[:] = steps
        return has_complex

    optimizer._init_group = _init_group  # type: ignore[method-assign]
    optimizer._dsx3d_pieces = piece  # type: ignore[attr-defined]
    return True


def basic_optimizer(engine: Any) -> Any:
    """The torch optimizer inside `engine`'s optimizer wrappers (ZeRO's, the bf16 and fp16 ones), or None."""
    opt = getattr(engine, "optimizer", None)
    for _ in range(4):
        if isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "optimizer"):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


def step_engine_in_pieces(engine: Any) -> bool:
    """`step_in_pieces` on the torch optimizer inside `engine`'s optimizer wrapper, the one that steps DeepSpeed's
    flat partitions; returns whether it applied. Without a wrapper (ZeRO-0 in fp32) the optimizer steps the
    model's own parameters, tensor by tensor as torch does, and is left alone."""
    inner = basic_optimizer(engine)
    return inner is not None and inner is not engine.optimizer and step_in_pieces(inner)
