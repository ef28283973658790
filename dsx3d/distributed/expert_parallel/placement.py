"""Which experts a rank holds (pure).

The E experts of an MoE layer are split along their leading dim over ep x tp "slots": the rank with expert
parallel index j (its DP index modulo ep) and TP index r holds slot s = j * tp + r, experts
[s * n, (s + 1) * n) with n = E / (ep * tp). Contiguous slots per EP rank mean an EP rank's tp ranks together
hold one contiguous range of E / ep experts, and the TP shards of a tensor concatenate in TP order like any
other dim-0 shard.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.num_experts % (self.tp * self.ep):
            raise ValueError(
                f"{self.num_experts} experts cannot be split evenly over ep x tp = {self.ep} x {self.tp} ranks"
            )

    @property
    def num_slots(self) -> int:
        return self.tp * self.ep

    @property
    def per_rank(self) -> int:
        """n = E / (ep * tp): experts one rank holds."""
        return self.num_experts // self.num_slots

    def slot(self, *, ep_rank: int, tp_rank: int) -> int:
        return ep_rank * self.tp + tp_rank

    def bounds(self, *, ep_rank: int, tp_rank: int) -> tuple[int, int]:
        """[start, stop) of the experts held by (ep_rank, tp_rank)."""
        start = self.slot(ep_rank=ep_rank, tp_rank=tp_rank) * self.per_rank
        return start, start + self.per_rank

    def owner(self, expert: int) -> tuple[int, int]:
        """(ep_rank, tp_rank) holding `expert`."""
        return divmod(expert // self.per_rank, self.tp)
