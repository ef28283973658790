"""Checker rules for `train.loss_tile_tokens` (the last stage's logits and loss a tile of tokens at a time)."""

from __future__ import annotations

from collections.abc import Iterator

from dsx3d.checks.context import _Context, _warning
from dsx3d.errors import Problem

KEY = "train.loss_tile_tokens"


def _loss_tiles(c: _Context) -> Iterator[Problem]:
    tile = c.recipe.train.loss_tile_tokens
    if tile == 0:
        return
    if c.recipe.zero.stage == 3:
        yield Problem(
            KEY,
            tile,
            "the tiled loss hands the LM head's weight gradient back through autograd from its own backward, "
            "where ZeRO-3 has already partitioned the head's weight again; tiling is verified with ZeRO stages 0-2",
            "set zero.stage: 2 (or lower), or train.loss_tile_tokens: 0",
        )
    tokens = c.recipe.train.micro_batch_size * c.recipe.train.seq_len
    if tile >= tokens:
        yield _warning(
            KEY,
            tile,
            f"a micro-batch holds {tokens} tokens (micro_batch_size x seq_len), so one tile holds them all: the "
            "logits are computed whole, and once more in the backward pass, which saves no memory",
            f"set it below {tokens} (a few thousand tokens per tile is typical), or to 0",
        )
