"""Checkpoints: OUTPUT_DIR/checkpoints/<tag>/ written by every rank through DeepSpeed, and a `latest` file
that names the newest complete one.

`latest` moves only after a barrier that every rank reaches once its files are written, and it moves
atomically (a temporary file renamed over it), so a job killed during a save leaves `latest` on the
previous complete checkpoint; the partial directory is overwritten when that step is saved again. Old
tags are deleted only after `latest` has moved. Each tag directory also holds the resolved recipe
(dsx3d_recipe.yaml, read by the export tool) and one RNG file per rank (DeepSpeed keeps client state once
per model-parallel rank, but random streams differ per rank).

Layout:

    checkpoints/latest                          the tag of the newest complete checkpoint
    checkpoints/step-000020/                    DeepSpeed's files: layer_XX-model_YY-model_states.pt,
                                                mp_rank_XX_model_states.pt (with our client state),
                                                zero_pp_rank_*_optim_states.pt
    checkpoints/step-000020/dsx3d_recipe.yaml   the resolved recipe (read by the export tool)
    checkpoints/step-000020/dsx3d_layout.json   dp, tp, pp, world_size (a resume must match them)
    checkpoints/step-000020/rng/rank-00003.pt   each rank's python, numpy, torch (and CUDA) RNG states
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsx3d.dist import comm
from dsx3d.engine import Engine3D
from dsx3d.errors import UserError

log = logging.getLogger("dsx3d")

LATEST = "latest"
RECIPE_FILE = "dsx3d_recipe.yaml"
LAYOUT_FILE = "dsx3d_layout.json"
CLIENT_KEY = "dsx3d"
_TAG = re.compile(r"^step-(\d+)$")


def tag_for(step: int) -> str:
    return f"step-{step:06d}"


def step_of(tag: str) -> int | None:
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def read_latest(ckpt_dir: Path) -> str | None:
    path = ckpt_dir / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    return tag or None


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same directory, fsync, rename over `path`: readers see the old
    content or the new one, never a mix, even if the writer dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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

    def __init__(self, run: Engine3D, ckpt_dir: Path, recipe_yaml: str, keep: int):
        self.run, self.dir, self.recipe_yaml, self.keep = run, ckpt_dir, recipe_yaml, keep
        self._universal: dict[str, Any] | None = None

    def _layout(self) -> dict[str, int]:
        layout = self.run.layout
        return {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "world_size": layout.world_size}

    def _check_layout(self, tag: str) -> None:
        """DeepSpeed would fail deep inside load_checkpoint (missing files) or, for dp, load ZeRO partitions
        of another shape; say what differs instead."""
        path = self.dir / tag / LAYOUT_FILE
        saved = json.loads(path.read_text()) if path.is_file() else None
        if saved is not None and saved != self._layout():
            raise UserError.single(
                "--resume",
                f"{tag} (dp {saved['dp']} x tp {saved['tp']} x pp {saved['pp']})",
                f"the checkpoint was written with another layout than this run's {self._layout()}",
                "resume with the layout and process count the checkpoint was written with",
            )

    def _rng_path(self, tag: str, rank: int) -> Path:
        return self.dir / tag / "rng" / f"rank-{rank:05d}.pt"

    def save(self, step: int, client_state: dict[str, Any]) -> str:
        tag, rank = tag_for(step), comm.get_rank()
        rng_path = self._rng_path(tag, rank)
        rng_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), rng_path)
        if rank == 0:
            write_text_atomic(self.dir / tag / RECIPE_FILE, self.recipe_yaml)
            write_text_atomic(self.dir / tag / LAYOUT_FILE, json.dumps(self._layout()) + "\n")
        if self._universal is None:  # how each parameter splits over TP: lets a tag become universal
            from dsx3d.checkpoint.universal import universal_client_state

            self._universal = universal_client_state(self.run)  # a collective, like save itself
        self.run.engine.save_checkpoint(
            str(self.dir), tag=tag, client_state={CLIENT_KEY: client_state, **self._universal}, save_latest=False
        )
        comm.barrier()  # every rank has written all of its files
        if rank == 0:
            write_text_atomic(self.dir / LATEST, tag)
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
        path, client = self.run.engine.load_checkpoint(str(self.dir), tag=tag)
        if path is None or CLIENT_KEY not in (client or {}):
            raise RuntimeError(f"DeepSpeed could not load checkpoint {self.dir / tag}")
        rng_path = self._rng_path(tag, comm.get_rank())
        if rng_path.is_file():
            set_rng_state(torch.load(rng_path, weights_only=False))
        return tag, client[CLIENT_KEY]
