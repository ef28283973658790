"""The parallel degrees of a job, once (`Degrees`): the recipe's `parallel` section, the rank layout, the
estimator's `Setup`, the planner's candidates and verify's cases all read them from this record."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Degrees:
    """dp x cp x tp x pp ranks; ep regroups DP ranks (it divides dp and adds no ranks); a pipeline rank holds
    `virtual_stages` model chunks (1: one contiguous stage)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_stages: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_size(self) -> int:
        """DeepSpeed's data-parallel degree: the dp x cp ranks that average gradients and share ZeRO states."""
        return self.dp * self.cp

    @property
    def model_parallel_size(self) -> int:
        """Ranks one replica of the weights is spread over: tp x pp."""
        return self.tp * self.pp


class HasDegrees:
    """A mix-in for records that carry dp, tp, pp (and cp, ep) fields: their `Degrees`, and the sizes derived
    from them in one place."""

    dp: int
    tp: int
    pp: int

    @property
    def degrees(self) -> Degrees:
        return Degrees(
            dp=self.dp, tp=self.tp, pp=self.pp, cp=getattr(self, "cp", 1), ep=getattr(self, "ep", 1),
            virtual_stages=getattr(self, "virtual_stages", 1),
        )

    @property
    def world_size(self) -> int:
        return self.degrees.world_size

    @property
    def data_size(self) -> int:
        return self.degrees.data_size
