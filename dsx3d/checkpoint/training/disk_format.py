"""The training-checkpoint format: the one place that knows how a dsx3d run's checkpoints are laid out.

Written by `dsx3d.checkpoint.training.checkpointer` (every rank, through DeepSpeed), read by the offline export
(`dsx3d.checkpoint.hf.offline_export`), the universal conversion and `--resume`:

    checkpoints/latest                          the tag of the newest complete checkpoint ("step-000020")
    checkpoints/step-000020/                    DeepSpeed's files. With a pipeline (pp > 1):
                                                layer_XX-model_YY-model_states.pt (one per pipeline item XX
                                                and TP rank YY; with expert parallelism the items holding
                                                experts have one per EP index ZZ instead,
                                                layer_XX-model_YY-expert_ZZ-model_states.pt),
                                                mp_rank_YY_model_states.pt (with dsx3d's client state),
                                                zero_pp_rank_*_optim_states.pt. Without one
                                                (pp = 1, DeepSpeed's regular engine): mp_rank_YY_model_states.pt
                                                holds TP rank YY's whole module and the client state, or with
                                                ZeRO-3 every DP rank D writes zero_pp_rank_D_mp_rank_YY_
                                                model_states.pt (client state, parameter shapes) and
                                                ..._optim_states.pt (its fp32 partitions)
    checkpoints/step-000020/dsx3d_recipe.yaml   the resolved recipe (read by the export tool)
    checkpoints/step-000020/dsx3d_layout.json   dp, tp, pp, ep (when > 1), world size, stage bounds, seq_len (a
                                                resume must match them or go through a universal copy)
    checkpoints/step-000020/rng/rank-00003.pt   each rank's python, numpy, torch (and CUDA) RNG states
    checkpoints/step-000020/files/rank-00003.json   the files rank 3 wrote and their sizes
    checkpoints/step-000020/dsx3d_checkpoint.json   every file's size and checksum, written last: a tag without it
                                                is incomplete (dsx3d.checkpoint.checksums)
    checkpoints/step-000020/universal/          a universal copy, made when a resume changes the layout
    checkpoints/step-000020/latest_universal    "universal" (written by DeepSpeed's converter)
    checkpoints/zero_to_fp32.py, zero_to_torch.py   DeepSpeed's converter scripts, copied at each save

A tag read from `latest`, from the command line or from anywhere else is a single plain path component
(`valid_tag`): a `latest` holding "../../.." can never make a reader leave the checkpoints directory.
Pure: no torch, no DeepSpeed.
"""

from __future__ import annotations

import re
from pathlib import Path

from dsx3d.errors import UserError

LATEST = "latest"
RECIPE_FILE = "dsx3d_recipe.yaml"
LAYOUT_FILE = "dsx3d_layout.json"
CLIENT_KEY = "dsx3d"
"""Key of dsx3d's own client state inside DeepSpeed's mp_rank_XX_model_states.pt."""
RNG_DIR = "rng"
FILES_DIR = "files"
UNIVERSAL_DIR = "universal"
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
MAX_LATEST_BYTES = 256

_STEP_TAG = re.compile(r"^step-(\d{6,})$")
LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)(?:-expert_(\d+))?-model_states\.pt$")
"""DeepSpeed's per-(pipeline item, TP rank) module file, and dsx3d's per-(item, TP rank, EP index) file of
an item holding experts split over an EP group (`dsx3d.pipeline.module.StagedPipelineModule`)."""
MODEL_STATES_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
"""Per TP rank: the client state; without a pipeline and below ZeRO-3 also the whole module."""
ZERO3_MODEL_STATES_FILE = re.compile(r"^zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$")
"""ZeRO-3, per TP rank (DP rank 0's): the client state and the shapes of the partitioned parameters."""


def layer_file_name(item: int, tp_rank: int, ep_index: int | None = None) -> str:
    """`ep_index` for an item holding experts split over an EP group, else None."""
    expert = "" if ep_index is None else f"-expert_{ep_index:02d}"
    return f"layer_{item:02d}-model_{tp_rank:02d}{expert}-model_states.pt"


def model_states_name(tp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def zero3_states_name(dp_rank: int, tp_rank: int, kind: str) -> str:
    """kind: "model" (client state, parameter shapes) or "optim" (the fp32 partitions)."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_{kind}_states.pt"


_ANY_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Files dsx3d and DeepSpeed write below checkpoints/: anything else there is somebody else's and is never
# deleted (dsx3d.run.outputs refuses to clear such a directory). Relative POSIX paths.
_OWNED = [
    re.compile(p)
    for p in (
        r"latest",
        r"\.latest\.[^/]*\.tmp",
        r"zero_to_fp32\.py",
        r"zero_to_torch\.py",
        r"(\.deleting-)?step-\d{6,}/layer_\d+-model_\d+(-expert_\d+)?-model_states\.pt",
        r"(\.deleting-)?step-\d{6,}/mp_rank_\d+_model_states\.pt",
        # pp > 1 and ZeRO-1/2: optimizer partitions; pp = 1 with ZeRO-3 also per-DP-rank module states
        r"(\.deleting-)?step-\d{6,}/(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(optim|model)_states\.pt",
        r"(\.deleting-)?step-\d{6,}/dsx3d_(recipe\.yaml|layout\.json|checkpoint\.json)",
        r"(\.deleting-)?step-\d{6,}/\.dsx3d_(recipe\.yaml|layout\.json|checkpoint\.json)\.[^/]*\.tmp",
        r"(\.deleting-)?step-\d{6,}/rng/rank-\d+\.pt",
        r"(\.deleting-)?step-\d{6,}/files/(\.)?rank-\d+\.json(\.[^/]*\.tmp)?",
        r"(\.deleting-)?step-\d{6,}/\.?universal(\.tmp[^/]*)?/.+",
        r"(\.deleting-)?step-\d{6,}/\.?latest_universal(\.[^/]*\.tmp)?",
        r"(\.deleting-)?step-\d{6,}/\.universal\.failed",
    )
]


def tag_for(step: int) -> str:
    return f"step-{step:06d}"


def step_of(tag: str) -> int | None:
    match = _STEP_TAG.match(tag)
    return int(match.group(1)) if match else None


def valid_tag(tag: str) -> bool:
    """A DeepSpeed tag dsx3d will open: one path component of letters, digits, '.', '_', '-', not starting
    with a dot (so never '.', '..', or a hidden temporary)."""
    return bool(_ANY_TAG.match(tag))


def check_tag(tag: str, key: str) -> str:
    if not valid_tag(tag):
        raise UserError.single(
            key,
            tag[:80],
            "not a checkpoint tag (one name of letters, digits, '.', '_' or '-', such as step-000020)",
            "name a tag directory of the checkpoint",
        )
    return tag


def read_latest(ckpt_dir: Path) -> str | None:
    """The tag `latest` names, checked; None when there is no `latest` file."""
    path = ckpt_dir / LATEST
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_LATEST_BYTES + 1)
        tag = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError.single(str(path), "(file)", f"unreadable ({err})", "restore it or remove it") from None
    if len(raw) > MAX_LATEST_BYTES or not valid_tag(tag):
        raise UserError.single(
            str(path),
            tag[:80],
            "does not hold a checkpoint tag (one plain name such as step-000020)",
            "write the name of a complete tag directory into it, or remove it",
        )
    return tag


def step_tags(ckpt_dir: Path) -> list[str]:
    """The step-NNNNNN tag directories, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(tags, key=lambda t: step_of(t) or 0)


def rng_path(tag_dir: Path, rank: int) -> Path:
    return tag_dir / RNG_DIR / f"rank-{rank:05d}.pt"


def files_path(tag_dir: Path, rank: int) -> Path:
    return tag_dir / FILES_DIR / f"rank-{rank:05d}.json"


def foreign_files(ckpt_dir: Path) -> list[str]:
    """Files below `ckpt_dir` that neither dsx3d nor DeepSpeed write there (relative paths)."""
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_dir() and not p.is_symlink():
            continue
        rel = p.relative_to(ckpt_dir).as_posix()
        if p.is_symlink() or not any(r.fullmatch(rel) for r in _OWNED):
            out.append(rel)
    return out


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
