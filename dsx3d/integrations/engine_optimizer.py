"""The optimizer HF's Trainer holds under dsx3d.Trainer: a live view of the engine optimizer's param groups."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsx3d.boundary_types import ParamGroup


class EngineOptimizer(torch.optim.Optimizer):
    """What HF's Trainer holds as its optimizer: a live view of the engine optimizer's param groups, so that HF's
    LR scheduler sets the learning rate the engine steps with. Live, not a copy of the list: loading a checkpoint
    replaces the engine optimizer's groups (torch's load_state_dict builds new dicts), and a view of the old ones
    would leave the engine at the loaded rate while HF's scheduler moved on. step() and zero_grad() do nothing:
    the engine steps and clears the real optimizer. `defaults` are the optimizer's settings, as HF's own
    optimizer would hold them (HF's polynomial schedule starts from defaults["lr"])."""

    def __init__(self, live_groups: Callable[[], list[ParamGroup]], defaults: dict[str, object]):
        self._live: Callable[[], list[ParamGroup]] | None = None
        super().__init__([torch.zeros(1, requires_grad=True)], defaults)  # torch's bookkeeping, on a placeholder
        self._live = live_groups

    @property  # type: ignore[override]
    def param_groups(self) -> list[ParamGroup]:
        return self._live() if self._live is not None else self.__dict__["_own_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[ParamGroup]) -> None:
        self.__dict__["_own_groups"] = groups  # only torch's __init__ assigns, before the view is live

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None
