"""The training-checkpoint format: the one place that knows how a dsx3d run's checkpoints are laid out.

Written by `dsx3d.run.checkpointing` (every rank, through DeepSpeed), read by the offline export
(`dsx3d.checkpoint.offline`), the universal conversion and `--resume`:

    checkpoints/latest                          the tag of the newest complete checkpoint
    checkpoints/step-000020/                    DeepSpeed's files. With a pipeline (pp > 1):
                                                layer_XX-model_YY-model_states.pt (one per pipeline item XX
                                                and TP rank YY), mp_rank_YY_model_states.pt (with dsx3d's
                                                client state), zero_pp_rank_*_optim_states.pt. Without one
                                                (pp = 1, DeepSpeed's regular engine): mp_rank_YY_model_states.pt
                                                holds TP rank YY's whole module and the client state, or with
                                                ZeRO-3 every DP rank D writes zero_pp_rank_D_mp_rank_YY_
                                                model_states.pt (client state, parameter shapes) and
                                                ..._optim_states.pt (its fp32 partitions)
    checkpoints/step-000020/dsx3d_recipe.yaml   the resolved recipe
    checkpoints/step-000020/dsx3d_layout.json   dp, tp, pp, world_size (a resume must match them)
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
LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
"""DeepSpeed's per-(pipeline item, TP rank) module file."""
MODEL_STATES_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
"""Per TP rank: the client state; without a pipeline and below ZeRO-3 also the whole module."""
ZERO3_MODEL_STATES_FILE = re.compile(r"^zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$")
"""ZeRO-3, per TP rank (DP rank 0's): the client state and the shapes of the partitioned parameters."""


def layer_file_name(item: int, tp_rank: int) -> str:
    return f"layer_{item:02d}-model_{tp_rank:02d}-model_states.pt"


def model_states_name(tp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def zero3_states_name(dp_rank: int, tp_rank: int, kind: str) -> str:
    """kind: "model" (client state, parameter shapes) or "optim" (the fp32 partitions)."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_{kind}_states.pt"


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


def layer_files(tag_dir: Path) -> dict[int, dict[int, Path]]:
    """pipeline item -> TP rank -> file, for the layer files of a tag directory."""
    out: dict[int, dict[int, Path]] = {}
    if tag_dir.is_dir():
        for p in tag_dir.iterdir():
            m = LAYER_FILE.match(p.name)
            if m:
                out.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    return out


def tp_rank_files(tag_dir: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    """TP rank -> file, for the files of a tag directory that match a per-TP-rank `pattern` above."""
    if not tag_dir.is_dir():
        return {}
    return {int(m.group(1)): p for p in tag_dir.iterdir() if (m := pattern.match(p.name))}


def is_tag_dir(path: Path) -> bool:
    """Whether `path` holds a checkpoint of either engine (not the checkpoints directory above its tags)."""
    return bool(
        layer_files(path) or tp_rank_files(path, MODEL_STATES_FILE) or tp_rank_files(path, ZERO3_MODEL_STATES_FILE)
    )
