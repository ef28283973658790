"""The last stage with `train.loss_tile_tokens` = N > 0: the head item hands the loss its hidden states
instead of logits, and the loss runs the head and the vocab-parallel cross-entropy N tokens at a time
(`dsx3d.distributed.tensor_parallel.tiled_loss`), so at most N x V/tp logits exist at once.

Each tile runs the CausalLM's own forward on its rows (the base model stubbed, as without tiling), so the
family's work on the logits (soft-capping, scaling) is the same; the head's linear reads the tile as this
rank's columns of an already entered input (`VocabParallelHead.plain`), and the hidden states enter the TP
region once, before the tiles. An MoE family's auxiliary loss does not depend on the hidden states: it is
computed once from the router logits, on one detached row. Token predictions, a user's loss function and
evaluation metrics ask for the full logits (`HeadInputs.logits`), which are then computed as without tiling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsx3d.distributed.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from dsx3d.distributed.tensor_parallel.layers import VocabParallelHead
from dsx3d.distributed.tensor_parallel.mappings import copy_to_tp, gather_from_sequence
from dsx3d.distributed.tensor_parallel.tiled_loss import ParamGrads, anchor, tiled_head_loss

if TYPE_CHECKING:
    from dsx3d.models.pipe_layers import LayerBuilder


@dataclass
class HeadInputs:
    """What the head item returns under tiling: the final hidden states (this rank's sequence shard under
    sequence parallelism; the anchor that hands back the head's gradients), the input ids, and the family's
    auxiliary loss terms (None without)."""

    builder: LayerBuilder
    hidden: torch.Tensor
    grads: ParamGrads
    input_ids: torch.Tensor
    aux: torch.Tensor | None
    training: bool

    def logits(self) -> torch.Tensor:
        """The whole micro-batch's logits shard (b, s, V/tp), as the head computes them without tiling."""
        b = self.builder
        with b.tp.item(self.hidden, training=self.training):
            out = b.skeleton.head(self.hidden, self.input_ids, None)
        assert isinstance(out, torch.Tensor)
        return out


def head_module(builder: LayerBuilder) -> VocabParallelHead:
    head = getattr(builder.skeleton.lm, builder.plan.head_name)
    assert isinstance(head, VocabParallelHead)
    return head


@contextlib.contextmanager
def _plain(head: VocabParallelHead) -> Iterator[None]:
    head.plain = True
    try:
        yield
    finally:
        head.plain = False


def head_inputs(
    builder: LayerBuilder,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    router_logits: torch.Tensor | None,
    training: bool,
) -> HeadInputs:
    """The head item's output under tiling (no logits); the auxiliary terms from the router logits."""
    aux = None
    if router_logits is not None:
        with _plain(head_module(builder)), builder.tp.item(hidden, training=training):
            _, aux = builder.skeleton.head(hidden[..., :1, :].detach(), input_ids[..., :1], router_logits)
    head = head_module(builder)
    anchored, grads = anchor(hidden, [p for p in (head.weight, head.bias) if p is not None])
    return HeadInputs(builder, anchored, grads, input_ids, aux, training)


def _entered_rows(inputs: HeadInputs) -> torch.Tensor:
    """The hidden states as (tokens, h) rows inside the TP region (entered once: its backward sums the tiles'
    per-column gradients over TP)."""
    tp, hidden = inputs.builder.tp, inputs.hidden
    if tp.size > 1:
        hidden = gather_from_sequence(hidden, tp.group) if tp.sequence_parallel else copy_to_tp(hidden, tp.group)
    return hidden.reshape(-1, hidden.shape[-1])


def logit_tiles(inputs: HeadInputs) -> Iterator[tuple[slice, torch.Tensor]]:
    """(rows, logits shard (n, V/tp)) of each tile of `loss_tile_tokens` tokens, without gradients (for metrics and
    for losses that need every token's value before their gradient, `tiled_loss_sum(weights=...)`)."""
    builder = inputs.builder
    head = head_module(builder)
    with torch.no_grad():
        rows = _entered_rows(inputs)
        ids = inputs.input_ids.reshape(-1)
        tile = builder.loss_tile_tokens
        for a in range(0, rows.shape[0], tile):
            sl = slice(a, min(a + tile, rows.shape[0]))
            with _plain(head):
                logits = builder.skeleton.head(rows[sl].unsqueeze(0), ids[sl].unsqueeze(0), None)
            assert isinstance(logits, torch.Tensor)
            yield sl, logits.reshape(-1, logits.shape[-1])


def tiled_loss_sum(inputs: HeadInputs, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of the per-token losses of the micro-batch (float32 scalar); `target`: (b * s,) shifted labels;
    `weights` (b * s,): each token's loss multiplied by its weight (a loss that is not a sum of token losses
    differentiates through it with its gradient for each token as the weight)."""
    builder = inputs.builder
    tp, head = builder.tp, head_module(builder)
    rows = _entered_rows(inputs)
    ids = inputs.input_ids.reshape(-1)
    if rows.shape[0] != target.shape[0]:
        raise RuntimeError(f"tiled loss: {rows.shape[0]} hidden rows for {target.shape[0]} labels")

    def run(h: torch.Tensor, sl: slice) -> torch.Tensor:
        with _plain(head):
            logits = builder.skeleton.head(h.unsqueeze(0), ids[sl].unsqueeze(0), None)
        assert isinstance(logits, torch.Tensor)
        losses = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target[sl], builder.vocab_start, builder.vocab, tp.group
        )
        return losses if weights is None else losses * weights[sl]

    return tiled_head_loss(run, builder.loss_tile_tokens, rows, inputs.grads)
