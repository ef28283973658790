"""Causal language modelling: every labelled token scored, the loss the token-weighted mean over the global batch."""

from __future__ import annotations

from dsx3d.objectives.base import Objective


class LanguageModeling(Objective):
    """The default objective of `dsx3d train` and `dsx3d.Trainer` (`Objective`'s defaults)."""

    name = "lm"
