"""Checks of the machine a run writes to and imports from: output and data directories, tracking and monitor packages."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

from dsx3d.checks.context import _Context
from dsx3d.errors import Problem

# DeepSpeed's monitor sections -> the package each needs.
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _monitor_packages(c: _Context) -> Iterator[Problem]:
    for section, package in MONITOR_PACKAGES.items():
        conf = c.overrides.get(section)
        if isinstance(conf, dict) and conf.get("enabled") and importlib.util.find_spec(package) is None:
            yield Problem(
                f"deepspeed.{section}.enabled",
                conf["enabled"],
                f"this monitor needs the {package} package, which is not installed",
                f"pip install {package}, or disable the section",
            )


def _output_dir(c: _Context) -> Iterator[Problem]:
    from dsx3d.fsio import output_dir_problem

    problem = output_dir_problem(c.recipe.output_dir)
    if problem:
        yield Problem(
            "output_dir",
            c.recipe.output_dir,
            problem,
            "set output_dir to a directory of its own, such as runs/NAME",
        )


def _data_dirs(c: _Context) -> Iterator[Problem]:
    """A local tokenizer directory and the cache directory are checked before any process starts (the data
    source by _data_source)."""
    data = c.recipe.data
    tokenizer = data.tokenizer
    if (
        tokenizer is not None
        and tokenizer.startswith(("/", "./", "../", "~"))
        and not Path(tokenizer).expanduser().is_dir()
    ):
        yield Problem(
            "data.tokenizer", tokenizer, "not a directory", "point it at a directory of tokenizer files"
        )
    cache = data.cache_dir
    if cache is not None and Path(cache).expanduser().exists() and not Path(cache).expanduser().is_dir():
        yield Problem("data.cache_dir", cache, "exists and is not a directory", "name a directory")


def _tracking_packages(c: _Context) -> Iterator[Problem]:
    """train.report_to backends drive the same DeepSpeed monitors (dsx3d.run.tracking); csv needs no package."""
    for backend in c.recipe.train.report_to:
        package = MONITOR_PACKAGES.get(backend)
        if package is not None and importlib.util.find_spec(package) is None:
            yield Problem(
                "train.report_to",
                backend,
                f"the {backend} backend needs the {package!r} package, which is not installed",
                f"pip install {package} (or `pip install dsx3d[tracking]`), or remove {backend!r} from train.report_to",
            )
