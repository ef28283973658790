"""Cross-entropy over vocab-sharded logits (Megatron's vocab-parallel cross-entropy, Shoeybi et al. 2019).

The LM head's logits stay split over the TP ranks by vocabulary; the loss needs only three all-reduces of
(tokens,) vectors (max, sum of exponentials, target logit) instead of gathering (tokens, vocab) logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsx3d.distributed.tensor_parallel.mappings import ProcessGroup, group_size

IGNORE_INDEX = -100
"""Label value that carries no loss (HF's convention)."""


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits without gathering them.

    logits: (n, v_local) this rank's columns [start, start + v_local); target: (n,) global ids, IGNORE_INDEX ignored;
    columns >= valid_vocab (padding) are excluded. Returns per-token losses (n,), 0 where ignored.
    loss_i = log(sum_j exp(z_ij - m_i)) - (z_i,t - m_i), with m_i, the sum and z_i,t all-reduced over TP.
    """

    @staticmethod
    def forward(ctx, logits, target, start, valid_vocab, group):
        z = logits.float()
        v_local = z.shape[-1]
        cols = torch.arange(start, start + v_local, device=z.device)
        pad = cols >= valid_vocab
        if bool(pad.any()):
            z = z.masked_fill(pad, float("-inf"))
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m.unsqueeze(-1)
        ez = z.exp()
        sum_ez = ez.sum(dim=-1)
        dist.all_reduce(sum_ez, group=group)
        ignored = target == IGNORE_INDEX
        local = target - start
        mine = (local >= 0) & (local < v_local) & ~ignored
        local = torch.where(mine, local, torch.zeros_like(local))
        z_t = torch.where(mine, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
        dist.all_reduce(z_t, group=group)
        loss = torch.where(ignored, torch.zeros_like(m), sum_ez.log() - z_t)
        softmax = ez / sum_ez.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, ignored = ctx.saved_tensors
        # d loss_i / d z_ij = softmax_ij - [j == t_i]
        grad = softmax.clone()
        rows = torch.nonzero(mine, as_tuple=True)[0]
        grad[rows, local[rows]] -= 1.0
        grad = grad * (grad_loss * (~ignored)).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, start: int, valid_vocab: int, group: ProcessGroup | None
) -> torch.Tensor:
    """Per-token loss for (n, v_local) logits; works for a single rank too (group None or size 1)."""
    if group_size(group) == 1:
        z = logits.float()
        if z.shape[-1] > valid_vocab:
            z = z[..., :valid_vocab]
        return torch.nn.functional.cross_entropy(z, target, ignore_index=IGNORE_INDEX, reduction="none")
    return _VocabParallelCE.apply(logits, target, start, valid_vocab, group)
