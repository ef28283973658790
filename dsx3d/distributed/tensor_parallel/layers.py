"""Megatron-style tensor-parallel layers that keep Hugging Face parameter names (`weight`, `bias`).

Sharded parameters carry `tensor_model_parallel = True`, which DeepSpeed's gradient norm reads to count them
on every TP rank (replicated ones are counted once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.mappings import split_last_dim
from dsx3d.distributed.tensor_parallel.weight_grad import linear as deferrable_linear


def mark_sharded(param: nn.Parameter, dim: int) -> None:
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]


def _empty_param(*shape: int, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=like.dtype, device=like.device), requires_grad=like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """y_local = f(x) @ W_local^T + b_local: (b, s, in) @ (in, out/t) -> (b, s, out/t); optionally gathered.
    Projections that read the same input share one f (`TPContext.column_linear`)."""

    def __init__(self, linear: nn.Linear, tp: TPContext, gather_output: bool = False):
        super().__init__()
        out_features, self.in_features = linear.weight.shape
        self.out_features = out_features // tp.size
        self.tp, self.gather_output = tp, gather_output
        self.weight = _empty_param(self.out_features, self.in_features, like=linear.weight)
        mark_sharded(self.weight, 0)
        self.bias = None
        if linear.bias is not None:
            self.bias = _empty_param(self.out_features, like=linear.bias)
            mark_sharded(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.column_linear(
            x, self.weight, self.bias, training=self.training, gather_output=self.gather_output
        )


class RowParallelLinear(nn.Module):
    """y = g(x_local @ W_local^T) + b: (b, s, in/t) @ (in/t, out) -> partial sums, all-reduced (with sequence
    parallelism reduce-scattered along the sequence), then the bias (added once, after the reduce)."""

    def __init__(self, linear: nn.Linear, tp: TPContext, split_input: bool = False):
        super().__init__()
        self.out_features, in_features = linear.weight.shape
        self.in_features = in_features // tp.size
        self.tp, self.split_input = tp, split_input
        self.weight = _empty_param(self.out_features, self.in_features, like=linear.weight)
        mark_sharded(self.weight, 1)
        self.bias = None if linear.bias is None else _empty_param(self.out_features, like=linear.bias)
        self.defer_weight_grad = False  # set by a zero-bubble engine (weight_grad.defer_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.on_shards:
            raise RuntimeError(
                "sequence parallelism: a row-parallel linear ran outside its parent module's forward; "
                "set parallel.sequence_parallel: false for this model"
            )
        if self.split_input:  # the input is replicated: keep this rank's columns
            x = split_last_dim(x, self.tp.group)
        y = self.tp.exit_region(
            deferrable_linear(x, self.weight) if self.defer_weight_grad else F.linear(x, self.weight),
            training=self.training,
        )
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding:
    """Turns an HF embedding module (nn.Embedding or a subclass that scales its output) into a vocab shard
    in place, so the family's own forward (scaling included) still runs: ids outside [start, stop) look up
    row 0 and are zeroed, then the partial embeddings are all-reduced (g), or with `scatter` reduce-scattered
    to this rank's sequence shard (sequence parallelism, when the rest of the prologue is token-wise)."""

    def __init__(self, embedding: nn.Embedding, tp: TPContext, padded_vocab: int):
        self.tp = tp
        self.scatter = False
        self.start, self.stop = tp.chunk_bounds(padded_vocab)
        n_local = self.stop - self.start
        embedding.weight = _empty_param(n_local, embedding.weight.shape[1], like=embedding.weight)
        mark_sharded(embedding.weight, 0)
        embedding.num_embeddings = n_local
        pad = embedding.padding_idx
        embedding.padding_idx = pad - self.start if pad is not None and self.start <= pad < self.stop else None
        self._outside: torch.Tensor | None = None
        embedding.register_forward_pre_hook(self._localize)
        embedding.register_forward_hook(self._combine)

    def _localize(self, module: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        self._outside = (ids < self.start) | (ids >= self.stop)
        local = torch.where(self._outside, torch.zeros_like(ids), ids - self.start)
        return (local, *args[1:])

    def _combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        assert self._outside is not None
        out = out.masked_fill(self._outside.unsqueeze(-1), 0.0)
        self._outside = None
        return self.tp.exit_region(out, training=module.training, scatter=self.scatter)


class VocabParallelHead(nn.Module):
    """logits_local = f(h) @ W_local^T: (b, s, h) @ (h, V/t) -> (b, s, V/t), never gathered; the loss is
    computed on the shards (`vocab_parallel_cross_entropy`). `weight` may be the tied embedding shard. With
    sequence parallelism f all-gathers the final norm's sequence shards."""

    def __init__(self, weight: nn.Parameter, tp: TPContext, vocab_start: int, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp, self.vocab_start = tp, vocab_start
        self.defer_weight_grad = False  # set by a zero-bubble engine (at tp > 1 the region defers on its own)
        self.plain = False
        """This rank's columns of an input already entered by the caller, no TP region and nothing deferred (the
        tiled loss, `dsx3d.models.tiled_loss`)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.defer_weight_grad and self.tp.size == 1:
            return deferrable_linear(hidden, self.weight, self.bias)
        full = self.tp.enter_region(hidden, training=self.training)
        return self.tp.column_linear(full, self.weight, self.bias, training=self.training)
