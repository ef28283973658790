"""The training-checkpoint format: the one place that knows how a dsx3d run's checkpoints are laid out.

Written by `dsx3d.run.checkpointing` (every rank, through DeepSpeed), read by the offline export
(`dsx3d.checkpoint.offline`), the universal conversion and `--resume`:

    checkpoints/latest                          the tag of the newest complete checkpoint
    checkpoints/step-000020/                    DeepSpeed's files: layer_XX-model_YY-model_states.pt (one per
                                                pipeline item XX and TP rank YY; with expert parallelism the
                                                items holding experts have one per EP index ZZ instead,
                                                layer_XX-model_YY-expert_ZZ-model_states.pt),
                                                mp_rank_XX_model_states.pt (with dsx3d's client state),
                                                zero_pp_rank_*_optim_states.pt
    checkpoints/step-000020/dsx3d_recipe.yaml   the resolved recipe
    checkpoints/step-000020/dsx3d_layout.json   dp, tp, pp, ep (when > 1), world_size (a resume must match them)
    checkpoints/step-000020/rng/rank-00003.pt   each rank's python, numpy, torch (and CUDA) RNG states
"""

from __future__ import annotations

import re
from pathlib import Path

LATEST = "latest"
RECIPE_FILE = "dsx3d_recipe.yaml"
LAYOUT_FILE = "dsx3d_layout.json"
CLIENT_KEY = "dsx3d"
"""Key of dsx3d's own client state inside DeepSpeed's mp_rank_XX_model_states.pt."""

_TAG = re.compile(r"^step-(\d+)$")
LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)(?:-expert_(\d+))?-model_states\.pt$")
"""DeepSpeed's per-(pipeline item, TP rank) module file, and dsx3d's per-(item, TP rank, EP index) file of
an item holding experts split over an EP group (`dsx3d.models.pipeline.StagedPipelineModule`)."""


def tag_for(step: int) -> str:
    return f"step-{step:06d}"


def step_of(tag: str) -> int | None:
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def read_latest(ckpt_dir: Path) -> str | None:
    """The tag `latest` names, or None when there is no (non-empty) `latest` file."""
    path = ckpt_dir / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    return tag or None


def rng_path(tag_dir: Path, rank: int) -> Path:
    return tag_dir / "rng" / f"rank-{rank:05d}.pt"


def layer_files(tag_dir: Path) -> dict[int, dict[tuple[int, int], Path]]:
    """pipeline item -> (TP rank, EP index) -> file, for the layer files of a tag directory (EP index 0 for
    the files of items without expert shards)."""
    out: dict[int, dict[tuple[int, int], Path]] = {}
    if tag_dir.is_dir():
        for p in tag_dir.iterdir():
            m = LAYER_FILE.match(p.name)
            if m:
                out.setdefault(int(m.group(1)), {})[(int(m.group(2)), int(m.group(3) or 0))] = p
    return out
