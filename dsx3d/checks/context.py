"""What every check rule looks at (the recipe, the world, the HF config) and how a rule reports a warning."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dsx3d.boundary_types import HFConfig
from dsx3d.errors import Problem
from dsx3d.models.shape import model_dim
from dsx3d.recipe.schema import Recipe


@dataclass(frozen=True)
class _Context:
    """What the rules look at: the recipe, the resolved world and dp, the HF config (None if unreadable)."""

    recipe: Recipe
    world_size: int
    world_source: str
    dp: int  # 0 when parallel.dp cannot be resolved
    hf_config: HFConfig | None

    @property
    def tp(self) -> int:
        return self.recipe.parallel.tp

    @property
    def pp(self) -> int:
        return self.recipe.parallel.pp

    @property
    def overrides(self) -> dict[str, Any]:
        return self.recipe.deepspeed

    def dim(self, name: str) -> int | None:
        return None if self.hf_config is None else model_dim(self.hf_config, name)


Rule = Callable[[_Context], Iterator[Problem]]


def _warning(key: str, value: object, reason: str, fix: str) -> Problem:
    return Problem(key, value, reason, fix, severity="warning")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
