"""Checked command-line values: bounded numbers (argparse types) and paths checked before any use.

A bad number is an argparse usage error naming the option (exit 2). A bad path is a `UserError` naming the
option (exit 2), raised before the command reads or writes anything else, so a refused command leaves
nothing behind. Sizes have upper bounds: a command given 1e9 ranks or layers refuses instead of building
tables that eat the machine's memory.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from dsx3d.errors import UserError
from dsx3d.fsio import name_problem
from dsx3d.recipe.schema import MAX_GPUS_PER_NODE, MAX_WORLD_SIZE

MAX_LAYERS = 512
"""Decoder layers (the cost-balanced stage split is a dynamic programme cubic in this)."""
MAX_HIDDEN = 1 << 20
MAX_COUNT = 1 << 31


def bounded_int(low: int = 1, high: int = MAX_COUNT) -> Callable[[str], int]:
    """argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {value}")
        return value

    return parse


def bounded_float(
    low: float = 0.0, high: float = math.inf, *, low_open: bool = True, high_open: bool = False
) -> Callable[[str], float]:
    """argparse type: a finite number in the interval (low, high] by default (nan and inf refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if not math.isfinite(value) or too_low or too_high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"expected a finite number in {interval}, got {text!r}")
        return value

    return parse


positive_int = bounded_int(1, MAX_COUNT)
world_size = bounded_int(1, MAX_WORLD_SIZE)
degree = bounded_int(1, MAX_WORLD_SIZE)
gpus_per_node = bounded_int(1, MAX_GPUS_PER_NODE)
layers = bounded_int(1, MAX_LAYERS)
port = bounded_int(1, 65535)


def _usable(option: str, path: str) -> Path:
    if not path or "\x00" in path:
        raise UserError.single(option, path, "not a usable path", "pass a file name")
    too_long = name_problem(path)
    if too_long:
        raise UserError.single(option, path, too_long, "use shorter names")
    return Path(path).expanduser()


def input_file(option: str, path: str, what: str = "file") -> Path:
    """An existing, readable regular file."""
    p = _usable(option, path)
    if not p.exists():
        raise UserError.single(option, path, "not found", f"pass an existing {what}")
    if not p.is_file():
        raise UserError.single(option, path, "not a regular file", f"pass a {what}")
    if not os.access(p, os.R_OK):
        raise UserError.single(option, path, "not readable", "fix its permissions")
    return p


def input_dir(option: str, path: str, what: str = "directory") -> Path:
    """An existing, readable directory."""
    p = _usable(option, path)
    if not p.is_dir():
        raise UserError.single(option, path, "not found" if not p.exists() else "not a directory", f"pass a {what}")
    if not os.access(p, os.R_OK | os.X_OK):
        raise UserError.single(option, path, "not readable", "fix its permissions")
    return p


def output_file(option: str, path: str, suffixes: tuple[str, ...] = ()) -> Path:
    """A file this command may create or replace: not a directory or device, with the right suffix, in a
    directory that exists or can be created by a user allowed to write to its nearest existing ancestor."""
    p = _usable(option, path)
    if suffixes and p.suffix.lower() not in suffixes:
        raise UserError.single(
            option, path, f"has the suffix {p.suffix or '(none)'!r}", f"name a file ending in {' or '.join(suffixes)}"
        )
    if p.is_dir():
        raise UserError.single(option, path, "is a directory", "name a file (for example inside that directory)")
    if p.exists() and not p.is_file():
        raise UserError.single(option, path, "exists and is not a regular file", "name a regular file")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError.single(option, path, "exists and is not writable", "fix its permissions or name another file")
    writable_parent(option, path, p.parent)
    return p


def output_dir(option: str, path: str) -> Path:
    """A directory this command may create or fill: not an existing file, creatable where it is."""
    p = _usable(option, path)
    if p.exists() and not p.is_dir():
        raise UserError.single(option, path, "exists and is not a directory", "name a directory")
    writable_parent(option, path, p if p.exists() else p.parent)
    return p


def writable_parent(option: str, path: str, parent: Path) -> None:
    """The nearest existing ancestor of `parent` must be a directory this process may write to."""
    ancestor = parent.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError.single(option, path, f"{ancestor} is not a directory", "choose another location")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError.single(option, path, f"{ancestor} is not writable", "choose a location you can write to")
