"""The run directory (recipe.output_dir) and what is saved beside the run.

OUTPUT_DIR/recipe.yaml         the resolved recipe (every default filled in)
OUTPUT_DIR/ds_config.json      the DeepSpeed config the engine was built with
OUTPUT_DIR/placement.json      every rank: host, pid, the launcher's node, and its pp/dp/tp coordinates
OUTPUT_DIR/tokenizer/          the tokenizer (save_pretrained)
OUTPUT_DIR/metrics.jsonl       one JSON object per logged step
OUTPUT_DIR/loss.png            the loss curve, drawn at the end
OUTPUT_DIR/checkpoints/        see dsx3d.run.checkpointing
OUTPUT_DIR/hf/                 the Hugging Face export at the end
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsx3d.checkpoint.training_format import read_latest
from dsx3d.errors import UserError
from dsx3d.fsio import write_atomic
from dsx3d.recipe import Recipe

log = logging.getLogger("dsx3d")


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @classmethod
    def of(cls, recipe: Recipe) -> RunPaths:
        return cls(Path(recipe.output_dir).expanduser())

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def ds_config(self) -> Path:
        return self.root / "ds_config.json"

    @property
    def placement(self) -> Path:
        return self.root / "placement.json"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def hf(self) -> Path:
        return self.root / "hf"


def check_start(paths: RunPaths, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run over the checkpoints of an earlier one unless told what to do."""
    latest = read_latest(paths.checkpoints)
    if latest is not None and not resume and not overwrite:
        raise UserError.single(
            "output_dir",
            str(paths.root),
            f"holds checkpoints of an earlier run (latest: {latest})",
            "pass --resume to continue it, --overwrite to start over (deletes its checkpoints and metrics), "
            "or set another output_dir",
        )


def clear_previous_run(paths: RunPaths) -> None:
    """What a fresh start replaces: checkpoints, metrics, the plot and the export of an earlier run."""
    for directory in (paths.checkpoints, paths.hf):
        shutil.rmtree(directory, ignore_errors=True)
    for path in (paths.metrics, paths.loss_plot):
        path.unlink(missing_ok=True)


def save_run_files(
    paths: RunPaths, recipe_yaml: str, ds_config: dict[str, Any], placement: list[dict[str, Any]]
) -> None:
    write_atomic(paths.recipe, recipe_yaml)
    write_atomic(paths.ds_config, json.dumps(ds_config, indent=2, sort_keys=True) + "\n")
    write_atomic(paths.placement, json.dumps(placement, indent=1) + "\n")


def add_start_mode(parser: argparse.ArgumentParser) -> None:
    """--resume / --overwrite, the choice `check_start` enforces (for `dsx3d train` and each rank)."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoints/latest")
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="start over, deleting an earlier run's checkpoints and metrics",
    )
