"""Saving and restoring a run's checkpoints (the format itself: `dsx3d.checkpoint.training_format`).

Every rank writes its files through DeepSpeed. `latest` moves only after a barrier that every rank reaches
once its files are written, and it moves atomically (a temporary file renamed over it), so a job killed
during a save leaves `latest` on the previous complete checkpoint; the partial directory is overwritten when
that step is saved again. Old tags are deleted only after `latest` has moved. Each tag directory also holds
the resolved recipe (read by the export tool) and one RNG file per rank (DeepSpeed keeps client state once
per model-parallel rank, but random streams differ per rank).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsx3d.checkpoint.training_format import (
    CLIENT_KEY,
    LATEST,
    LAYOUT_FILE,
    RECIPE_FILE,
    read_latest,
    rng_path,
    step_of,
    tag_for,
)
from dsx3d.distributed import comm
from dsx3d.engine import Engine3D
from dsx3d.errors import UserError
from dsx3d.fsio import make_dirs, share_tree, write_atomic

log = logging.getLogger("dsx3d")

def tags_to_delete(tags: list[str], latest: str, keep: int) -> list[str]:
    """Tags older than the `keep` newest up to `latest`. Tags after `latest` are left alone: they are
    being written, or are the remains of a save that crashed and will be overwritten."""
    newest = step_of(latest)
    if newest is None:
        return []
    done = sorted((s, t) for t in tags if (s := step_of(t)) is not None and s <= newest)
    return [t for _, t in done[: max(0, len(done) - keep)]]


def prune(ckpt_dir: Path, keep: int) -> list[str]:
    latest = read_latest(ckpt_dir)
    if latest is None:
        return []
    doomed = tags_to_delete([p.name for p in ckpt_dir.iterdir() if p.is_dir()], latest, keep)
    for tag in doomed:
        # Rename first: a crash in the middle of rmtree must not leave a half-deleted dir named like a tag.
        trash = ckpt_dir / f".deleting-{tag}"
        os.replace(ckpt_dir / tag, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves and restores one run's checkpoints. `save` and `load_latest` are collectives."""

    def __init__(self, engine: Engine3D, ckpt_dir: Path, recipe_yaml: str, keep: int):
        self.engine, self.dir, self.recipe_yaml, self.keep = engine, ckpt_dir, recipe_yaml, keep
        self._universal: dict[str, Any] | None = None

    def _layout(self) -> dict[str, int]:
        layout = self.engine.layout
        expert = {"ep": layout.ep} if layout.ep > 1 else {}  # absent at ep 1: earlier checkpoints still match
        return {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, **expert, "world_size": layout.world_size}

    def _check_layout(self, tag: str) -> None:
        """DeepSpeed would fail deep inside load_checkpoint (missing files) or, for dp, load ZeRO partitions
        of another shape; say what differs instead."""
        path = self.dir / tag / LAYOUT_FILE
        saved = json.loads(path.read_text()) if path.is_file() else None
        if saved is not None and saved != self._layout():
            raise UserError.single(
                "--resume",
                f"{tag} (dp {saved['dp']} x tp {saved['tp']} x pp {saved['pp']}, ep {saved.get('ep', 1)})",
                f"the checkpoint was written with another layout than this run's {self._layout()}",
                "resume with the layout and process count the checkpoint was written with",
            )

    def save(self, step: int, client_state: dict[str, Any]) -> str:
        tag, rank = tag_for(step), comm.get_rank()
        rng_file = rng_path(self.dir / tag, rank)
        make_dirs(rng_file.parent)  # also the checkpoints directory and the tag's, readable by others
        torch.save(rng_state(), rng_file)
        if rank == 0:
            write_atomic(self.dir / tag / RECIPE_FILE, self.recipe_yaml)
            write_atomic(self.dir / tag / LAYOUT_FILE, json.dumps(self._layout()) + "\n")
        if self._universal is None:  # how each parameter splits over TP: lets a tag become universal
            from dsx3d.checkpoint.universal import universal_client_state

            self._universal = universal_client_state(self.engine)  # a collective, like save itself
        self.engine.ds_engine.save_checkpoint(
            str(self.dir), tag=tag, client_state={CLIENT_KEY: client_state, **self._universal}, save_latest=False
        )
        comm.barrier()  # every rank has written all of its files
        # DeepSpeed writes with the process umask (and copies its zero_to_fp32 scripts beside the tags);
        # a run's checkpoints are read by colleagues
        share_tree(self.dir / tag)
        share_tree(self.dir, recursive=False)
        if rank == 0:
            write_atomic(self.dir / LATEST, tag)
            deleted = prune(self.dir, self.keep)
            log.info(
                "checkpoint %s saved%s", self.dir / tag, f"; deleted {', '.join(deleted)}" if deleted else ""
            )
        return tag

    def load_latest(self) -> tuple[str, dict[str, Any]] | None:
        """(tag, client state) of the newest complete checkpoint, loaded into the engine; None if none."""
        latest = comm.broadcast_object(read_latest(self.dir) if comm.get_rank() == 0 else None)
        if latest is None:
            return None
        tag = str(latest)
        self._check_layout(tag)
        path, client = self.engine.ds_engine.load_checkpoint(str(self.dir), tag=tag)
        if path is None or CLIENT_KEY not in (client or {}):
            raise RuntimeError(f"DeepSpeed could not load checkpoint {self.dir / tag}")
        rng_file = rng_path(self.dir / tag, comm.get_rank())
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return tag, client[CLIENT_KEY]
