"""What the Trainer's mixins (data loaders, evaluation, saving) may use of `dsx3d.Trainer` itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import transformers

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D
    from dsx3d.integrations.trainer import _State
    from dsx3d.plan.layout import Layout


class EngineTrainerBase(transformers.Trainer):
    """`transformers.Trainer` plus the 3D engine's state, which `dsx3d.Trainer` defines."""

    if TYPE_CHECKING:
        _dsx3d: _State

        @property
        def layout(self) -> Layout: ...

        def _engine(self) -> Engine3D: ...

        def _shape_rows(self, rows: int) -> None: ...

        def _count_over_dp(self, local: int) -> int: ...
