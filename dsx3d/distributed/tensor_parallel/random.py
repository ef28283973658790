"""Dropout random streams under tensor parallelism (Megatron's RNG tracker, without global state).

Two kinds of activations need two kinds of masks:
- *replicated* activations (the residual stream, outputs of row-parallel linears, embeddings) are the same
  tensor on every TP rank, so their dropout masks must be identical on every TP rank, or the replicas
  silently diverge. They draw from the default generator, seeded identically on the ranks of a TP group.
- *sharded* activations (a rank's own attention heads or MLP columns, between a column-parallel and a
  row-parallel linear) must get independent masks on each TP rank, as one process would draw independent
  masks for different heads.

Entering a sharded region (a column-parallel linear's output) draws one 62-bit number from the default
generator, which therefore advances identically on every TP rank, and reseeds the generator of the
activations' device with (that number, TP rank); leaving it (a row-parallel linear) restores the default
state saved on entry. The sharded stream is thus a function of the default generator's state, so:
activation-checkpoint recomputation (which restores the default state) redraws the same masks, a resumed
run that restores each rank's default RNG state resumes every stream, and nothing else needs saving.

Only models with dropout switch streams (`active`); without dropout nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant (2^64 / golden ratio): spreads TP ranks' seeds apart


def default_seed(seed: int, *, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
    """The default generator's seed of a rank: identical on the ranks of a TP group (replicated masks
    equal), different across pipeline stages, DP ranks and CP ranks (different layers, different data,
    different slices of a sequence and, inside attention, different heads). cp_rank 0 adds nothing."""
    return (seed * 1_000_003 + pp_rank * 7_919 + dp_rank * 104_729 + cp_rank * 15_485_863 + 0xD5) % (2**63)


def seed_ranks(seed: int, *, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> None:
    """Seed every default generator (CPU and accelerators) of this process for dropout."""
    torch.manual_seed(default_seed(seed, pp_rank=pp_rank, dp_rank=dp_rank, cp_rank=cp_rank))


@dataclass
class TPRandom:
    """The dropout streams of one TP rank (one per stage builder; explicit, not global)."""

    tp_rank: int = 0
    active: bool = False
    """True when the model has dropout; otherwise entering and leaving regions does nothing."""
    _saved: tuple[torch.device, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def in_sharded_region(self) -> bool:
        return self._saved is not None

    def enter_sharded(self, x: torch.Tensor, training: bool) -> None:
        """The activations of `x`'s device now differ per TP rank: switch to this rank's stream."""
        if not (self.active and training) or self._saved is not None:
            return
        device = x.device
        draw = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())  # the CPU default stream
        self._saved = (device, _state(device))
        _seed(device, (draw ^ (_GOLDEN * (self.tp_rank + 1))) % (2**63))

    def leave_sharded(self) -> None:
        """Back to the replicated stream, exactly where it was on entry (plus the one draw)."""
        if self._saved is None:
            return
        device, state = self._saved
        self._saved = None
        _set_state(device, state)


def _state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seed(device: torch.device, seed: int) -> None:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
