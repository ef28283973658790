"""The run directory (recipe.output_dir), what is saved beside the run, and what a fresh start may remove.

OUTPUT_DIR/dsx3d_run.json      the files dsx3d wrote here (dsx3d.checkpoint.manifest)
OUTPUT_DIR/recipe.yaml         the resolved recipe (every default filled in)
OUTPUT_DIR/ds_config.json      the DeepSpeed config the engine was built with
OUTPUT_DIR/placement.json      every rank: host, pid, the launcher's node, and its pp/dp/tp coordinates
OUTPUT_DIR/tokenizer/          the tokenizer (save_pretrained)
OUTPUT_DIR/metrics.jsonl       one JSON object per logged step
OUTPUT_DIR/loss.png            the loss curve, drawn at the end
OUTPUT_DIR/checkpoints/        see dsx3d.checkpoint.training.disk_format
OUTPUT_DIR/hf/                 the Hugging Face export at the end (with its own dsx3d_export.json); LoRA
                               runs: the merged model, with model.lora.merge_on_export only
OUTPUT_DIR/adapter/            LoRA runs: the adapters in peft's format (with its own dsx3d_export.json)

dsx3d only ever deletes what it wrote: a fresh start over an earlier run removes the files the run's
manifest names, the checkpoint files of the training-checkpoint format and the files an export's manifest
names, and refuses (naming them) if any other file sits where it would write or delete. It removes an
earlier run only when told to (--overwrite, or --resume finding no checkpoint to resume), and says what it
removes. An output_dir of /, a top-level directory, the home directory or the working directory (or one
of their parents) is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsx3d.boundary_types import HFProcessor
from dsx3d.checkpoint.manifest import describe, files_under, read_manifest, record, unknown_files
from dsx3d.checkpoint.training.disk_format import foreign_files, read_latest
from dsx3d.errors import UserError
from dsx3d.fsio import make_dirs, output_dir_problem, share_tree, write_atomic
from dsx3d.recipe.schema import Recipe

log = logging.getLogger("dsx3d")

ROOT_FILES = ("recipe.yaml", "ds_config.json", "placement.json", "metrics.jsonl", "loss.png")
"""Files rank 0 writes at the top of the run directory (named in its manifest)."""
_OWNED_DIRS = ("checkpoints", "hf", "adapter", "tokenizer")


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

    @property
    def adapter(self) -> Path:
        """LoRA runs: the adapters in peft's format (dsx3d.checkpoint.hf.lora_export)."""
        return self.root / "adapter"




def check_output_dir(paths: RunPaths) -> None:
    problem = output_dir_problem(paths.root)
    if problem is None:
        ancestor = paths.root.absolute()
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
            problem = f"cannot be written ({ancestor} is not a writable directory)"
    if problem:
        raise UserError.single(
            "output_dir", str(paths.root), problem, "set output_dir to a directory of its own, such as runs/NAME"
        )


@dataclass(frozen=True)
class EarlierRun:
    """What an earlier run left in the run directory: files dsx3d wrote, and files it did not."""

    ours: list[str]
    foreign: list[str]
    latest: str | None


def earlier_run(paths: RunPaths) -> EarlierRun:
    """Every file a fresh start would replace or remove, split into dsx3d's own and anybody else's
    (relative to the run directory)."""
    manifest = read_manifest(paths.root, "run") or set()
    ours: list[str] = []
    foreign: list[str] = []
    if (paths.root / "dsx3d_run.json").is_file() and manifest:
        ours.append("dsx3d_run.json")
    for name in ROOT_FILES:
        if (paths.root / name).exists() or (paths.root / name).is_symlink():
            (ours if name in manifest else foreign).append(name)
    for rel in files_under(paths.tokenizer):
        (ours if f"tokenizer/{rel}" in manifest else foreign).append(f"tokenizer/{rel}")
    bad = set(foreign_files(paths.checkpoints))
    for rel in files_under(paths.checkpoints):
        (foreign if rel in bad else ours).append(f"checkpoints/{rel}")
    for export in (paths.hf, paths.adapter):
        strangers = set(unknown_files(export, "export")) if export.is_dir() else set()
        for rel in files_under(export):
            (foreign if rel in strangers else ours).append(f"{export.name}/{rel}")
        if export.exists() and not export.is_dir():
            foreign.append(export.name)
    if paths.checkpoints.exists() and not paths.checkpoints.is_dir():
        foreign.append("checkpoints")
    return EarlierRun(ours, foreign, read_latest(paths.checkpoints) if paths.checkpoints.is_dir() else None)


def summarize(files: list[str]) -> str:
    """'checkpoints step-000002, step-000004 (57 files); hf/ (6 files); metrics.jsonl'."""
    groups: dict[str, list[str]] = {}
    for f in files:
        top = f.split("/", 1)[0]
        groups.setdefault(top, []).append(f)
    parts = []
    for top, members in groups.items():
        if top == "checkpoints":
            tags = sorted({m.split("/")[1] for m in members if m.count("/") >= 2})
            parts.append(f"checkpoints/ ({', '.join(tags) or 'no tags'}; {len(members)} files)")
        elif top in _OWNED_DIRS:
            parts.append(f"{top}/ ({len(members)} files)")
        else:
            parts.append(top)
    return "; ".join(parts)


def check_start(paths: RunPaths, *, resume: bool, overwrite: bool) -> list[str]:
    """Refuse a start that would lose something; return the files of an earlier run that this start
    removes (empty when it removes nothing). Pure reading: nothing is deleted here."""
    check_output_dir(paths)
    earlier = earlier_run(paths)
    if resume and earlier.latest is not None:
        rewritten = [f for f in earlier.foreign if f.split("/", 1)[0] in ("recipe.yaml", "ds_config.json", "placement.json", "metrics.jsonl", "tokenizer")]
        if rewritten:
            raise UserError.single(
                "output_dir",
                str(paths.root),
                f"holds files dsx3d did not write where a resumed run writes ({describe(rewritten)})",
                "move them away",
            )
        return []
    if earlier.foreign:
        raise UserError.single(
            "output_dir",
            str(paths.root),
            f"holds files dsx3d did not write where a run writes or clears its own ({describe(earlier.foreign)}); "
            "dsx3d deletes only what it wrote",
            "move them away, or set another output_dir",
        )
    if not earlier.ours:
        return []
    if not overwrite and not resume:
        what = f"latest: {earlier.latest}" if earlier.latest else "no complete checkpoint"
        raise UserError.single(
            "output_dir",
            str(paths.root),
            f"holds an earlier run ({what}): {summarize(earlier.ours)}",
            "pass --resume to continue it, --overwrite to start over (removes exactly those files), "
            "or set another output_dir",
        )
    return earlier.ours


def describe_removal(paths: RunPaths, removed: list[str], *, resume: bool) -> str:
    why = "--resume found no complete checkpoint, so the run starts over" if resume else "--overwrite"
    return f"{why}: removing the earlier run's files in {paths.root}: {summarize(removed)}"


def remove_earlier_run(paths: RunPaths, files: list[str]) -> None:
    """Delete exactly `files` (from check_start), then the directories they leave empty below
    checkpoints/, hf/ and tokenizer/ (and those three when empty). Nothing else."""
    for rel in files:
        (paths.root / rel).unlink(missing_ok=True)
    for top in _OWNED_DIRS:
        base = paths.root / top
        if not base.is_dir() or base.is_symlink():
            continue
        for directory in sorted((p for p in base.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
            if not any(directory.iterdir()):
                directory.rmdir()
        if not any(base.iterdir()):
            base.rmdir()


def start_run_directory(paths: RunPaths, removed: list[str], *, resume: bool) -> None:
    """Rank 0, once, before anybody writes: remove what check_start allowed, name the files this run writes."""
    if removed:
        log.info("%s", describe_removal(paths, removed, resume=resume))
        remove_earlier_run(paths, removed)
    make_dirs(paths.root)  # 0755 whatever the umask: colleagues read a run
    record(paths.root, "run", ROOT_FILES)


def save_run_files(
    paths: RunPaths, recipe_yaml: str, ds_config: dict[str, Any], placement: list[dict[str, Any]]
) -> None:
    write_atomic(paths.recipe, recipe_yaml)
    write_atomic(paths.ds_config, json.dumps(ds_config, indent=2, sort_keys=True, allow_nan=False) + "\n")
    write_atomic(paths.placement, json.dumps(placement, indent=1) + "\n")


def save_tokenizer(paths: RunPaths, tokenizer: HFProcessor) -> None:
    tokenizer.save_pretrained(str(paths.tokenizer))
    share_tree(paths.tokenizer)
    record(paths.root, "run", (f"tokenizer/{f}" for f in files_under(paths.tokenizer)))


def add_start_mode(parser: argparse.ArgumentParser) -> None:
    """--resume / --overwrite, the choice `check_start` enforces (for `dsx3d train` and each rank)."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUTPUT_DIR/checkpoints/latest (at any layout: resharded when it changed); "
        "without a checkpoint, start over",
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="start over, removing the earlier run's files (only files dsx3d wrote; it says which)",
    )
