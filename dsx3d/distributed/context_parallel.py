"""Context parallelism (Ulysses): every sequence split over the cp ranks of a CP group.

Outside attention a rank holds its slice of every sequence: tokens [r*s/cp, (r+1)*s/cp) for CP rank r (with
sequence parallelism, a further TP shard of it). Attention needs every position, so around the attention
function of each decoder layer DeepSpeed's `UlyssesSPAttentionHF` exchanges (all-to-all over the CP group)
the slices of all heads for all positions of cp-th of the heads: q, k and v enter as (b, heads, s/cp, d),
the attention function runs on (b, heads/cp, s, d) with the whole sequence's mask, and the output goes back
to (b, s/cp, heads*d). Heads are the ones this TP rank holds; kv heads fewer than cp are repeated, which is
exact (each query head still meets its own kv head).

What is whole and what is sliced, per decoder layer call (`CPContext.local_call`): the mask (causal, per
document for packed rows, sliding window) is built for the whole sequence, because it is applied after the
exchange; the rotary tables and `position_ids` are this rank's rows, because they are applied to q and k
before it (Ulysses all-gathers `position_ids` for the attention function). Between pipeline stages the
position_ids of the whole sequence travel (an integer tensor), gathered once by the first stage.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from dsx3d.hf_modules import attention_modules, head_dim

ATTN_NAME = "dsx3d_cp_ulysses"
"""The attention implementation name the owned attention modules dispatch through (`install`)."""

_registered = False


def _dispatch(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object = None,
    *args: object,
    **kwargs: object,
) -> object:
    """The registered attention function: the module's own Ulysses wrapper."""
    return module.__dict__["_dsx3d_ulysses"](module, query, key, value, attention_mask, *args, **kwargs)


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _dispatch)
        _registered = True


def _ulysses_class() -> type[nn.Module]:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class Ulysses(UlyssesSPAttentionHF):  # type: ignore[misc]
        """DeepSpeed's wrapper, with the batch size read from each call (micro-batches may differ)."""

        batch_size: int
        required_query_shape: torch.Size
        required_key_value_shape: torch.Size
        required_context_shape: torch.Size

        def forward(self, module: nn.Module, query: torch.Tensor, *args: object, **kwargs: object) -> object:
            b = query.shape[0]
            if b != self.batch_size:
                self.batch_size = b
                q, kv, c = self.required_query_shape, self.required_key_value_shape, self.required_context_shape
                self.required_query_shape = torch.Size([q[0], b, *q[2:]])
                self.required_key_value_shape = torch.Size([kv[0], b, *kv[2:]])
                self.required_context_shape = torch.Size([c[0], b, *c[2:]])
            return super().forward(module, query, *args, **kwargs)

    return Ulysses



def _heads_split(attn: nn.Module) -> bool:
    """Whether TP split this attention module's heads: a column-parallel projection whose output stays
    sharded (a `colwise` plan entry); not where the plan keeps attention whole or gathers the outputs."""
    from dsx3d.distributed.tensor_parallel.layers import ColumnParallelLinear

    return any(isinstance(m, ColumnParallelLinear) and not m.gather_output for m in attn.modules())



@dataclass
class CPContext:
    """This rank's place in its CP group; `group` is bound once the groups exist (None while size == 1)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = field(default=None, repr=False)

    def bind(self, group: dist.ProcessGroup | None) -> None:
        if self.size > 1:
            self.group = group

    @property
    def on(self) -> bool:
        return self.size > 1

    def rows(self, s: int) -> slice:
        """This rank's slice of a sequence of s positions."""
        part = s // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def gather_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """(b, s/cp) position_ids of every CP rank -> (b, s), in CP-rank order (no gradient)."""
        return self.gather_sequence(positions)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s/cp, ...) of every CP rank -> (b, s, ...), in CP-rank order, without a gradient (position ids;
        the predictions dsx3d.Trainer's evaluation keeps). Unchanged while size == 1."""
        if not self.on:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(..., tokens of this rank, h) -> (..., tokens of every CP rank, h), in CP-rank order; backward sums
        the (identical) gradients of the whole over the group and keeps this rank's rows. An MoE router's
        load-balancing loss is a product of means over all tokens of the micro-batch: each CP rank computes
        it from every rank's router logits, and DeepSpeed's mean over the CP ranks of the summed gradient
        is the gradient of that one loss."""
        from dsx3d.distributed.tensor_parallel.mappings import gather_from_sequence

        return gather_from_sequence(x, self.group)

    def local_call(self, kwargs: dict[str, object], s: int) -> dict[str, object]:
        """A decoder layer's recorded keyword arguments for the whole sequence -> this rank's: rotary tables
        and position ids (and cache positions) cut to its rows; masks stay whole (module docstring)."""
        rows = self.rows(s)
        out = dict(kwargs)
        for key in ("position_ids", "cache_position"):
            value = out.get(key)
            if isinstance(value, torch.Tensor) and value.shape[-1] == s:
                out[key] = value[..., rows]
        if "position_embeddings" in out:
            out["position_embeddings"] = _cut(out["position_embeddings"], rows, s)
        return out

    def install(self, layer: nn.Module, tp: int, num_layers: int) -> None:
        """Route the attention modules of `layer` through DeepSpeed's Ulysses wrapper over this CP group,
        around the attention function the family was built with (sdpa, eager, ...)."""
        mods = attention_modules(layer)
        if not mods:
            raise RuntimeError(f"context parallelism: no attention module found in {type(layer).__name__}")
        _register()
        ulysses = _ulysses_class()
        for attn in mods:
            if hasattr(attn, "sinks") or hasattr(attn, "s_aux"):
                raise RuntimeError(f"context parallelism: {type(attn).__name__} has per-head attention sinks")
            config = cast(PretrainedConfig, attn.config)
            core = _core_attention(attn, config._attn_implementation)
            split = tp if _heads_split(attn) else 1  # a plan that keeps attention whole: all heads here
            heads = config.num_attention_heads // split
            # the key/value heads the attention function gets: HF's repeat them by the module's
            # num_key_value_groups (1 where a family has none, as GPT-NeoX, whose config may still carry an
            # unused num_key_value_heads)
            kv = config.num_attention_heads // getattr(attn, "num_key_value_groups", 1)
            attn.__dict__["_dsx3d_ulysses"] = ulysses(
                attn=core,
                batch_size=1,
                attn_head_count=heads,
                attn_head_size=head_dim(attn),
                kv_head_count=kv // split,
                num_hidden_layers=num_layers,
                process_group=self.group,
                seq_length_is_variable=True,
            )
            own = copy.copy(config)
            own.__dict__["_attn_implementation_internal"] = ATTN_NAME
            attn.__dict__["config"] = own  # a plain attribute, as HF sets it


def _cut(value: object, rows: slice, s: int) -> object:
    if isinstance(value, torch.Tensor):
        return value[:, rows] if value.dim() >= 2 and value.shape[1] == s else value
    if isinstance(value, tuple):
        return tuple(_cut(v, rows, s) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v, rows, s) for k, v in value.items()}
    return value


def _core_attention(attn: nn.Module, implementation: str | None) -> Callable[..., object]:
    """The attention function the family's module would call for `implementation`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(attn).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"context parallelism: {type(attn).__name__} has no eager attention function")
    if implementation in (None, "eager"):
        return cast(Callable[..., object], eager)
    return cast(Callable[..., object], ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager))


def create_cp_group(groups: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create every CP group (on every rank, in the same order) and return this rank's; None when cp = 1."""
    mine = None
    for ranks in groups:
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    return mine
