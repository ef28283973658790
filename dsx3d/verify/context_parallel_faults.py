"""Deliberate defects in context parallelism, to show that `dsx3d verify --cp` catches each one (the same
mechanism as `dsx3d.verify.faults`: a patch in this process that the forked ranks inherit)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.faults import _patched


def attention_without_all_to_all() -> contextlib.AbstractContextManager[None]:
    """The Ulysses exchange is left out: each rank's attention sees only its own slice of the sequence (its
    rows of the whole sequence's mask)."""
    from dsx3d.distributed.context_parallel import CPContext

    original = CPContext.install

    def install(self: CPContext, layer: nn.Module, tp: int, num_layers: int) -> None:
        original(self, layer, tp, num_layers)
        from dsx3d.hf_modules import attention_modules

        rank = self.rank
        for attn in attention_modules(layer):
            core = attn.__dict__["_dsx3d_ulysses"].attn

            def local(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, *a: object, _core: Callable[..., object] = core, **kw: object) -> object:
                if isinstance(mask, torch.Tensor):
                    s, part = mask.shape[-1], q.shape[2]
                    rows = slice(rank * part, (rank + 1) * part)
                    mask = mask[..., rows, rows] if s != part else mask
                return _core(module, q, k, v, mask, *a, **kw)

            attn.__dict__["_dsx3d_ulysses"] = local

    return _patched(CPContext, "install", install)


def positions_of_the_first_slice() -> contextlib.AbstractContextManager[None]:
    """Every CP rank applies the rotary tables of the first slice (positions 0 .. s/cp - 1) to its own."""
    from dsx3d.distributed.context_parallel import CPContext

    def rows(self: CPContext, s: int) -> slice:
        return slice(0, s // self.size)

    return _patched(CPContext, "rows", rows)


def aux_loss_from_own_tokens() -> contextlib.AbstractContextManager[None]:
    """An MoE router's load-balancing loss computed by each CP rank from its own slice's router logits (a
    product of means over half the tokens), not from every rank's."""
    from dsx3d.distributed.context_parallel import CPContext

    return _patched(CPContext, "gather_tokens", lambda self, x: x)


@dataclass(frozen=True)
class CPFault:
    description: str
    layout: tuple[int, int, int, int]
    """(dp, cp, tp, pp) where the defect matters."""
    config: Callable[[], PretrainedConfig]
    patch: Callable[[], contextlib.AbstractContextManager[None]]


def _llama() -> PretrainedConfig:
    return tiny_config("llama", tie_word_embeddings=False)


def _mixtral() -> PretrainedConfig:
    """Top-2 of 4 experts with the load-balancing loss weighted up (0.5), so that it moves every gradient."""
    return tiny_config("mixtral", num_local_experts=4, output_router_logits=True, router_aux_loss_coef=0.5)


CP_FAULTS: dict[str, CPFault] = {
    "attention without the all-to-all": CPFault(
        "each CP rank attends over its own slice only", (1, 2, 1, 1), _llama, attention_without_all_to_all
    ),
    "rotary positions of the wrong slice": CPFault(
        "every CP rank rotates q and k by the first slice's positions", (1, 2, 1, 1), _llama, positions_of_the_first_slice
    ),
    "load-balancing loss from one slice": CPFault(
        "each CP rank's router loss sees only its own tokens", (1, 2, 1, 1), _mixtral, aux_loss_from_own_tokens
    ),
}
