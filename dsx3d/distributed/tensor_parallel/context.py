"""The tensor-parallel coordinates a stage needs, with the process group bound once the groups exist,
and the region boundaries every TP layer goes through.

Entering a TP region (Megatron's `f`: the input of column-parallel linears, experts, ...) and leaving it
(`g`: the output of row-parallel linears) are the only places where activations change between replicated
(or, with sequence parallelism, sequence-sharded) and per-rank. Layers call `enter_region` / `exit_region`
(and `column_linear` for the projections that read an entered input) instead of the raw mappings, so what
happens at a boundary (the collective, the dropout stream) is decided here, once:

- one entry per distinct input tensor within a pipeline item: q, k and v (gate and up; attention and MLP of
  parallel-residual layers) read the same input and share one entry, so their input gradients are summed
  and reduced by one collective, launched asynchronously under the last projection's weight gradient
  (`regions.RegionEntry`). The memo is cleared at the pipeline items' edges (`item`);
- `sequence_parallel`: outside the regions activations are (b, s/t, h) sequence shards; an entry
  all-gathers the sequence (backward: reduce-scatter) and an exit reduce-scatters it (backward:
  all-gather). `depth` counts the region modules running (their forward pre-hooks, `region_module_hooks`),
  so code knows whether it sees the whole sequence (depth > 0) or this rank's shard (depth 0).

Dropout streams (`random.TPRandom`): without sequence parallelism, replicated activations draw from the
stream the TP group shares and per-rank activations (a rank's heads, its MLP columns) from the rank's own
stream, switched at the first per-rank output of a region and back at its exit. With sequence parallelism
every activation of a decoder layer is per-rank (a shard of the sequence, or a rank's heads), so an item
that starts on a shard runs on the rank's own stream throughout.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dsx3d.distributed.tensor_parallel.mappings import (
    copy_to_tp,
    gather_last_dim,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    split_to_sequence,
)
from dsx3d.distributed.tensor_parallel.random import TPRandom
from dsx3d.distributed.tensor_parallel.regions import RegionEntry, enter, region_linear


@dataclass(frozen=True)
class LoraPath:
    """One LoRA adapter on a TP projection: y += scaling * B A dropout(x), with x the projection's input.

    Column-parallel (y_r = W_r x + s B_r A x, r = this rank's output columns): A (rank, in) is replicated,
    B_r (out/t, rank) is this rank's rows of B. z = A x is replicated; dz_r = B_r^T dy_r is partial over TP,
    so dA = dz_r^T x must be summed over TP (a gradient hook, `dsx3d.models.lora`) and the input gradient
    A^T dz_r is partial like W_r^T dy_r: the down projection is one more consumer of the region entry
    (`region_linear`), so its part is summed with the projections' before the entry's one collective.
    Row-parallel (y = g(W_r x_r + s B A_r x_r)): A_r (rank, in/t) is this rank's columns of A and B (out,
    rank) is replicated; B is linear, so the sum over ranks of B A_r x_r is B A x and the term joins the
    partial sums before the exit's reduction; dB = dy^T z_r is partial (summed over TP), dA_r is local."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout: nn.Module

    def _mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """The scaled dropout mask (None without dropout): applied through the entry's autograd function."""
        if isinstance(self.dropout, nn.Identity) or not self.dropout.training:
            return None
        return self.dropout(torch.ones_like(x))

    def column_term(self, full: torch.Tensor, entry: RegionEntry) -> torch.Tensor:
        """(b, s, in) @ (in, rank) -> z, replicated; z @ (rank, out/t) -> this rank's columns."""
        z = region_linear(full, self.a, None, entry, self._mask(full))
        return torch.nn.functional.linear(z, self.b) * self.scaling

    def row_term(self, x_local: torch.Tensor) -> torch.Tensor:
        """(b, s, in/t) @ (in/t, rank) @ (rank, out): this rank's partial sum, reduced with the projection's."""
        z = torch.nn.functional.linear(self.dropout(x_local), self.a)
        return torch.nn.functional.linear(z, self.b) * self.scaling


@dataclass
class TPContext:
    """rank/size are known from the layout before any process group exists; `group` is bound later: with a
    pipeline to DeepSpeed's grid's TP ("slice") group, without one to the TP group of
    dsx3d.distributed.groups.DataTensorParallelGroups (None while size == 1)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, repr=False)
    random: TPRandom = field(default_factory=TPRandom, repr=False)
    sequence_parallel: bool = False
    """Activations outside TP regions are split along the sequence (set by the builder, only with size > 1)."""
    overlap: bool = True
    """Launch an entry's gradient collective asynchronously under the last weight gradient (False: wait at
    once; for benchmarks)."""
    shared_entries: bool = True
    """Projections that read one input share one entry, so one TP collective (False: one entry and one
    collective per projection, which benchmarks compare against)."""
    depth: int = field(default=0, repr=False)
    _by_input: dict[int, tuple[torch.Tensor, torch.Tensor, RegionEntry]] = field(default_factory=dict, repr=False)
    _by_output: dict[int, tuple[torch.Tensor, RegionEntry]] = field(default_factory=dict, repr=False)
    _rows: dict[int, int] = field(default_factory=dict, repr=False)
    """Full row count (dim -2) seen by region modules being run, by depth (sequence parallelism)."""

    def __post_init__(self) -> None:
        self.random.tp_rank = self.rank

    def bind(self, group: object) -> None:
        if self.size > 1:
            self.group = group

    def chunk_bounds(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's even share of n (n % size == 0, checked by the caller)."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    @property
    def on_shards(self) -> bool:
        """Activations here are this rank's sequence shard (sequence parallelism, outside every region)."""
        return self.sequence_parallel and self.depth == 0

    # -- entries --------------------------------------------------------------------------------------------

    def _entry(self, x: torch.Tensor, gather: bool) -> tuple[torch.Tensor, RegionEntry]:
        """The entry of `x` (memoized per input tensor), or of the entry whose output `x` is."""
        hit = self._by_output.get(id(x))
        if hit is not None and hit[0] is x:
            return x, hit[1]
        known = self._by_input.get(id(x))
        if known is not None and known[0] is x:
            return known[1], known[2]
        entry = RegionEntry(self.group, gather, self.overlap)
        full = enter(x, entry)
        if self.shared_entries:
            self._by_input[id(x)] = (x, full, entry)
            self._by_output[id(full)] = (full, entry)
        return full, entry

    def enter_region(self, x: torch.Tensor, *, training: bool) -> torch.Tensor:
        """Replicated (or sequence-sharded) `x` feeds per-rank computation (f): the same input entered twice
        gives the same output, so its consumers' gradients are reduced once. With sequence parallelism the
        result holds the whole sequence. Dropout from here on draws this rank's own masks."""
        if self.size == 1:
            return x
        full, _ = self._entry(x, gather=self.on_shards)
        self.random.enter_sharded(x, training)
        return full

    def enter_partial(self, x: torch.Tensor, *, training: bool) -> torch.Tensor:
        """Replicated `x` feeds per-rank computation that is not a column-parallel projection (MoE experts:
        each rank runs the routes to its own experts), so the gradient reaching `x` through autograd is
        partial over TP and is all-reduced (Megatron's f as such, no shared entry). Not on sequence shards:
        models with such regions run without sequence parallelism (`tp_plan.sequence_parallel_blockers`)."""
        if self.size == 1:
            return x
        if self.on_shards:
            raise RuntimeError("sequence parallelism: a partial-gradient TP region got a sequence shard")
        self.random.enter_sharded(x, training)
        return copy_to_tp(x, self.group)

    def column_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        training: bool,
        gather_output: bool = False,
        lora: Sequence[LoraPath] = (),
    ) -> torch.Tensor:
        """A column-parallel projection (b, s, in) @ (in, out/t) -> (b, s, out/t) inside a region: `x` is an
        entered input, or is entered here (memoized). `gather_output` all-gathers the output columns, which
        leaves the result replicated (no per-rank dropout stream). `lora`: adapters added to this rank's
        columns before any gather (`LoraPath`)."""
        if self.size == 1:
            return torch.nn.functional.linear(x, weight, bias)  # LoRA at tp = 1 is peft's own layer
        if self.on_shards and not self._is_entered(x):
            raise RuntimeError(
                "sequence parallelism: a column-parallel linear was called on a sequence shard outside its "
                "parent module's forward; set parallel.sequence_parallel: false for this model"
            )
        if self.shared_entries:
            full, entry = self._entry(x, gather=False)
        else:  # shared_entries=False: one entry and one collective per projection (benchmarks)
            entry = RegionEntry(self.group, False, self.overlap)
            full = enter(x, entry)
        y = region_linear(full, weight, bias, entry)
        for path in lora:
            y = y + path.column_term(full, entry)
        if gather_output:
            return gather_last_dim(y, self.group)
        self.random.enter_sharded(x, training)
        return y

    def _is_entered(self, x: torch.Tensor) -> bool:
        hit = self._by_output.get(id(x))
        return hit is not None and hit[0] is x

    # -- exits ------------------------------------------------------------------------------------------------

    def exit_region(self, y: torch.Tensor, *, training: bool = False, scatter: bool | None = None) -> torch.Tensor:
        """Per-rank partial sums become the replicated result (g: all-reduce), or with sequence parallelism
        this rank's summed sequence shard (reduce-scatter) when leaving the outermost region. Dropout from
        here on draws the masks every TP rank shares, or with sequence parallelism this rank's own."""
        if self.size == 1:
            return y
        if scatter is None:
            scatter = self.sequence_parallel and self.depth <= 1
        if scatter:
            out = reduce_scatter_to_sequence(y, self.group)
            self.random.enter_sharded(out, training)
            return out
        out = reduce_from_tp(y, self.group)
        self.random.leave_sharded()
        return out

    def scatter_sequence(self, x: torch.Tensor, *, training: bool) -> torch.Tensor:
        """Replicated (b, s, h) -> this rank's (b, s/t, h) shard, no communication (backward: all-gather);
        dropout from here on draws this rank's own masks."""
        if self.size == 1:
            return x
        out = split_to_sequence(x, self.group)
        self.random.enter_sharded(out, training)
        return out

    # -- pipeline items --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def item(self, x: torch.Tensor | None = None, *, training: bool = False) -> Iterator[None]:
        """A pipeline item's forward: it starts and ends with no region open and no entries remembered. With
        sequence parallelism and an input `x` (a shard), the item runs on this rank's dropout stream."""
        self.close_regions()
        if x is not None and self.sequence_parallel:
            self.random.enter_sharded(x, training)
        try:
            yield
        finally:
            self.close_regions()

    def close_regions(self) -> None:
        """At the edges of a pipeline item: whatever a layer left open, the replicated stream is back."""
        self._by_input.clear()
        self._by_output.clear()
        self._rows.clear()
        self.depth = 0
        self.random.leave_sharded()

    # -- region modules (sequence parallelism) -------------------------------------------------------------

    def region_module_hooks(self, module: nn.Module) -> None:
        """Make `module` (the parent of column-parallel linears: attention, MLP) a TP region under sequence
        parallelism: its hidden-states argument is entered (all-gathered) before its forward, so the module
        sees the whole sequence (Hugging Face attention takes its shapes from that argument), and an output
        that comes out whole (a `colwise_gather_output` projection last) is cut back to this rank's shard."""
        name = _first_parameter(module)
        module.register_forward_pre_hook(lambda m, a, k: self._pre_region(a, k, name), with_kwargs=True)
        module.register_forward_hook(lambda m, a, out: self._post_region(out))

    def _pre_region(self, args: tuple, kwargs: dict[str, object], name: str) -> tuple[tuple, dict[str, object]] | None:
        if not self.sequence_parallel:
            return None
        self.depth += 1
        if self.depth > 1:  # nested region: the input already holds the whole sequence
            return None
        x = args[0] if args else kwargs.get(name)
        if not isinstance(x, torch.Tensor):
            raise RuntimeError(f"sequence parallelism: a TP region module got no tensor argument {name!r}")
        full, _ = self._entry(x, gather=True)
        self._rows[self.depth] = full.shape[-2]
        if args:
            return (full, *args[1:]), kwargs
        return args, {**kwargs, name: full}

    def _post_region(self, out: object) -> Any:
        if not self.sequence_parallel:
            return None
        self.depth -= 1
        rows = self._rows.pop(self.depth + 1, None)
        if self.depth > 0 or rows is None:
            return None
        first = out[0] if isinstance(out, tuple) else out
        if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.shape[-2] != rows:
            return None  # already this rank's shard (a row-parallel linear reduce-scattered it)
        shard = split_to_sequence(first, self.group)  # replicated and whole: keep this rank's rows
        return (shard, *out[1:]) if isinstance(out, tuple) else shard


def _first_parameter(module: nn.Module) -> str:
    """The name of the first parameter of `module.forward` (its hidden states: `hidden_states`, `x`)."""
    params = list(inspect.signature(module.forward).parameters)
    return params[0] if params else "hidden_states"
