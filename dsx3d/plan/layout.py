"""Where every rank sits: dp x cp x tp x pp over nodes x gpus_per_node (pure: no processes, no DeepSpeed).

Rank order is DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model): TP ranks are adjacent,
then CP, then DP, then PP, i.e. rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index.
Context parallelism (cp) splits every sequence over cp ranks that hold the same weights: DeepSpeed sees the
dp x cp ranks of a stage and TP index as its data axis (data coordinate dp_index * cp + cp_index), so it
averages gradients and partitions ZeRO states over them, while the data stream is chosen by dp_index alone
and each CP rank takes its slice of the sequence. Expert parallelism (ep, dividing
dp) groups `ep` consecutive DP indices of one stage and TP index; each such EP group splits the experts of a
layer, and the ranks that hold the same experts (same ep index, one per EP group) form an expert-data-parallel
group, as DeepSpeed's `groups._get_expert_parallel_ranks` builds them. The order is computed here, so the
pure layer (recipe, checker, planner, estimator, `dsx3d plan`) never imports DeepSpeed;
tests/unit/test_layout.py checks it equals DeepSpeed's topology over a grid of shapes, and
`dsx3d.distributed.topology.pipeline_topology` hands DeepSpeed's own object to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsx3d.plan.degrees import Degrees, HasDegrees


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int
    local_rank: int
    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout(HasDegrees):
    """The layout of one job. `gpus_per_node` decides the node of each rank (rank // gpus_per_node).
    `ep` (expert parallelism) divides dp: it regroups DP ranks, it adds no ranks. `cp` (context parallelism)
    adds an axis between TP and DP; ep > 1 with cp > 1 is not supported."""

    dp: int
    tp: int
    pp: int
    gpus_per_node: int
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "gpus_per_node", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(f"Layout.ep = {self.ep} must divide dp = {self.dp}")
        if self.ep > 1 and self.cp > 1:
            raise ValueError(f"Layout.ep = {self.ep} with cp = {self.cp}: expert and context parallelism do not combine")

    @classmethod
    def of(cls, degrees: Degrees, gpus_per_node: int) -> Layout:
        """The layout of `degrees` on nodes of `gpus_per_node` ranks."""
        return cls(dp=degrees.dp, tp=degrees.tp, pp=degrees.pp, gpus_per_node=gpus_per_node, ep=degrees.ep, cp=degrees.cp)

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    def rank_of(self, *, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def placement(self, rank: int) -> RankPlacement:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the layout's {self.world_size} ranks")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return RankPlacement(
            rank=rank, node=rank // self.gpus_per_node, local_rank=rank % self.gpus_per_node, pp=pp, dp=dp, tp=tp, cp=cp
        )

    def placements(self) -> list[RankPlacement]:
        return [self.placement(r) for r in range(self.world_size)]

    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(pp=p, dp=d, cp=c, tp=t) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
            for c in range(self.cp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Ranks that read different data and hold the same weights and sequence slice (same stage, cp, tp)."""
        return [
            [self.rank_of(pp=p, dp=d, cp=c, tp=t) for d in range(self.dp)]
            for p in range(self.pp)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def cp_groups(self) -> list[list[int]]:
        """Ranks that split one sequence (same stage, dp and tp index): the all-to-all around attention.
        Empty without context parallelism."""
        if self.cp == 1:
            return []
        return [
            [self.rank_of(pp=p, dp=d, cp=c, tp=t) for c in range(self.cp)]
            for p in range(self.pp)
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def data_groups(self) -> list[list[int]]:
        """DeepSpeed's data axis: the dp x cp ranks of one stage and TP index, which average gradients and
        partition ZeRO states (equal to dp_groups without context parallelism)."""
        return [
            [self.rank_of(pp=p, dp=d, cp=c, tp=t) for d in range(self.dp) for c in range(self.cp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(pp=p, dp=d, cp=c, tp=t) for p in range(self.pp)]
            for d in range(self.dp)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def ep_rank(self, rank: int) -> int:
        """Index of `rank` inside its EP group: which share of every MoE layer's experts it holds."""
        return self.placement(rank).dp % self.ep

    def ep_groups(self) -> list[list[int]]:
        """Ranks that exchange tokens (all-to-all) and split every MoE layer's experts: ep consecutive DP
        indices of one stage and one TP index. Empty without expert parallelism."""
        if self.ep == 1:
            return []
        return [
            [self.rank_of(pp=p, dp=block + e, tp=t) for e in range(self.ep)]
            for p in range(self.pp)
            for block in range(0, self.dp, self.ep)
            for t in range(self.tp)
        ]

    def edp_groups(self) -> list[list[int]]:
        """Expert-data-parallel groups: ranks holding the same experts (same stage, TP index and ep index),
        over which expert gradients are reduced and ZeRO partitions the experts' optimizer state."""
        if self.ep == 1:
            return []
        return [
            [self.rank_of(pp=p, dp=block + e, tp=t) for block in range(0, self.dp, self.ep)]
            for p in range(self.pp)
            for e in range(self.ep)
            for t in range(self.tp)
        ]

    def tied_groups(self) -> list[list[int]]:
        """Ranks that share the tied embedding / LM head: first and last stage, same dp and tp index."""
        if self.pp == 1:
            return []
        return [
            [self.rank_of(pp=0, dp=d, cp=c, tp=t), self.rank_of(pp=self.pp - 1, dp=d, cp=c, tp=t)]
            for d in range(self.dp)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def stage_ranks(self, stage: int) -> list[int]:
        per_stage = self.dp * self.cp * self.tp
        return list(range(stage * per_stage, (stage + 1) * per_stage))

    def crosses_node(self, group: list[int]) -> bool:
        return len({r // self.gpus_per_node for r in group}) > 1

    def node_crossings(self, pipeline: list[int]) -> list[tuple[int, int]]:
        """Stage boundaries (s, s+1) of one pipeline whose two ranks sit on different nodes."""
        return [
            (s, s + 1)
            for s in range(len(pipeline) - 1)
            if pipeline[s] // self.gpus_per_node != pipeline[s + 1] // self.gpus_per_node
        ]

    def tp_crosses_node(self) -> bool:
        return any(self.crosses_node(g) for g in self.tp_groups())

    def dp_crosses_node(self, stage: int) -> bool:
        """Whether a DP group of `stage` spans nodes."""
        return any(self.crosses_node(g) for g in self.dp_groups() if self.placement(g[0]).pp == stage)

    def cp_crosses_node(self) -> bool:
        return any(self.crosses_node(g) for g in self.cp_groups())

    def ep_crosses_node(self) -> bool:
        return any(self.crosses_node(g) for g in self.ep_groups())

    def boundary_crosses_node(self, stage: int) -> bool:
        """Whether the link from `stage` to `stage + 1` leaves a node (for any pipeline)."""
        return any(self.crosses_node([g[stage], g[stage + 1]]) for g in self.pp_groups())

    def ends_cross_node(self) -> bool:
        """Whether the first and last stage of a pipeline (the tied-weight pair) sit on different nodes."""
        return any(self.crosses_node([g[0], g[-1]]) for g in self.pp_groups())

    def describe(self) -> dict:
        """Everything `dsx3d plan --json` prints about the layout, as plain data."""
        return {
            "world_size": self.world_size,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "cp": self.cp,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.num_nodes,
            "ranks": [vars(p) for p in self.placements()],
            "tp_groups": self.tp_groups(),
            "dp_groups": self.dp_groups(),
            "cp_groups": self.cp_groups(),
            "data_groups": self.data_groups(),
            "pp_groups": self.pp_groups(),
            "tied_groups": self.tied_groups(),
            "ep_groups": self.ep_groups(),
            "edp_groups": self.edp_groups(),
        }


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle fraction of a synchronous 1F1B pipeline: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)
