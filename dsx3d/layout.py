"""Where every rank sits: dp x tp x pp over nodes x gpus_per_node.

Rank order comes from DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model): TP ranks are
adjacent, then DP, then PP. Nothing here needs a process group.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from functools import cached_property

# DeepSpeed's logger writes to stdout and already logs while importing (accelerator detection). Importing it
# with stdout pointed at stderr binds its handler to stderr, so stdout stays clean for `dsx3d plan --json`.
with contextlib.redirect_stdout(sys.stderr):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int
    local_rank: int
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """The 3D layout of one job. `gpus_per_node` decides the node of each rank (rank // gpus_per_node)."""

    dp: int
    tp: int
    pp: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    @cached_property
    def topology(self) -> PipeModelDataParallelTopology:
        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

    def placement(self, rank: int) -> RankPlacement:
        # The topology's row-major order over (pipe, data, model), computed rather than looked up:
        # ProcessTopology.get_coord scans every rank, which made a placement table quadratic in the world.
        # rank = (pp_rank * dp + dp_rank) * tp + tp_rank; tests compare both for every rank.
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        rest, tp_rank = divmod(rank, self.tp)
        pp_rank, dp_rank = divmod(rest, self.dp)
        return RankPlacement(
            rank=rank,
            node=rank // self.gpus_per_node,
            local_rank=rank % self.gpus_per_node,
            pp=pp_rank,
            dp=dp_rank,
            tp=tp_rank,
        )

    def placements(self) -> list[RankPlacement]:
        return [self.placement(r) for r in range(self.world_size)]

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        return self.topology.get_axis_comm_lists("model") or [[r] for r in range(self.world_size)]

    def dp_groups(self) -> list[list[int]]:
        return self.topology.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]

    def pp_groups(self) -> list[list[int]]:
        return self.topology.get_axis_comm_lists("pipe") or [[r] for r in range(self.world_size)]

    def tied_groups(self) -> list[list[int]]:
        """Ranks that share the tied embedding / LM head: first and last stage, same dp and tp index."""
        if self.pp == 1:
            return []
        return [
            [self.rank_of(pp=0, dp=d, tp=t), self.rank_of(pp=self.pp - 1, dp=d, tp=t)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def stage_ranks(self, stage: int) -> list[int]:
        return sorted(self.topology.filter_match(pipe=stage))

    def crosses_node(self, group: list[int]) -> bool:
        return len({r // self.gpus_per_node for r in group}) > 1

    def node_crossings(self, pipeline: list[int]) -> list[tuple[int, int]]:
        """Stage boundaries (s, s+1) of one pipeline whose two ranks sit on different nodes."""
        return [
            (s, s + 1)
            for s in range(len(pipeline) - 1)
            if pipeline[s] // self.gpus_per_node != pipeline[s + 1] // self.gpus_per_node
        ]

    def describe(self) -> dict:
        """Everything `dsx3d plan --json` prints about the layout, as plain data."""
        return {
            "world_size": self.world_size,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.num_nodes,
            "ranks": [vars(p) for p in self.placements()],
            "tp_groups": self.tp_groups(),
            "dp_groups": self.dp_groups(),
            "pp_groups": self.pp_groups(),
            "tied_groups": self.tied_groups(),
        }


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle fraction of a synchronous 1F1B pipeline: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)
