"""Checkpoint tags on disk: which to keep, removing one, whether one is complete, and which to resume from."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dsx3d.checkpoint.checksums import has_manifest, sum_problems
from dsx3d.checkpoint.safe_load import file_problem
from dsx3d.checkpoint.training.disk_format import (
    FILES_DIR,
    LAYOUT_FILE,
    check_tag,
    files_path,
    foreign_files,
    is_tag_dir,
    read_latest,
    step_of,
    step_tags,
)
from dsx3d.errors import Problem, UserError

log = logging.getLogger("dsx3d")


def tags_to_delete(tags: list[str], latest: str, keep: int) -> list[str]:
    """Tags older than the `keep` newest up to `latest`. Tags after `latest` are left alone: they are
    being written, or are the remains of a save that crashed and will be overwritten."""
    newest = step_of(latest)
    if newest is None:
        return []
    done = sorted((s, t) for t in tags if (s := step_of(t)) is not None and s <= newest)
    return [t for _, t in done[: max(0, len(done) - keep)]]


def remove_tag(ckpt_dir: Path, tag: str) -> list[str]:
    """Delete the files dsx3d and DeepSpeed wrote in a tag directory, then its directories left empty.
    Returns the files left (somebody else's), which are never deleted. The directory is renamed first, so a
    crash in the middle never leaves a half-deleted directory named like a complete tag."""
    source = ckpt_dir / tag
    trash = ckpt_dir / f".deleting-{tag}"
    if source.is_dir():
        os.replace(source, trash)
    if not trash.is_dir():
        return []
    foreign = {f for f in foreign_files(ckpt_dir) if f.startswith(f"{trash.name}/")}
    for p in sorted(trash.rglob("*"), reverse=True):
        rel = p.relative_to(ckpt_dir).as_posix()
        if p.is_dir() and not p.is_symlink():
            if not any(p.iterdir()):
                p.rmdir()
        elif rel not in foreign:
            p.unlink()
    if any(trash.iterdir()):
        os.replace(trash, source)  # keep somebody's files where they were
        return sorted(f.split("/", 1)[1] for f in foreign)
    trash.rmdir()
    return []


def prune(ckpt_dir: Path, keep: int) -> list[str]:
    latest = read_latest(ckpt_dir)
    if latest is None:
        return []
    for trash in sorted(ckpt_dir.glob(".deleting-step-*")):  # a deletion that a kill interrupted: finish it
        if not (ckpt_dir / trash.name.removeprefix(".deleting-")).exists():
            remove_tag(ckpt_dir, trash.name.removeprefix(".deleting-"))
    doomed = tags_to_delete(step_tags(ckpt_dir), latest, keep)
    for tag in doomed:
        left = remove_tag(ckpt_dir, tag)
        if left:
            log.warning(
                "kept %s: it holds files dsx3d did not write (%s)", ckpt_dir / tag, ", ".join(left[:5])
            )
    return doomed


def tag_problems(tag_dir: Path) -> list[str]:
    """What is wrong with a tag directory ('file: reason'), empty when it is complete and loads safely."""
    if not tag_dir.is_dir():
        return [f"{tag_dir}: missing"]
    lists = sorted((tag_dir / FILES_DIR).glob("rank-*.json"))
    if has_manifest(tag_dir) or any(_listed_format(p) >= 2 for p in lists):  # sizes and checksums, written last
        problems = sum_problems(tag_dir)
        if problems:
            return problems
        return [f"{p}: {why}" for p in sorted(tag_dir.glob("*.pt")) if (why := file_problem(p))]
    if not lists:  # written before dsx3d listed its files: check DeepSpeed's files as they are
        files = [p for p in tag_dir.glob("*.pt")]
        if not is_tag_dir(tag_dir):  # any engine's model-states files (pipeline, pp = 1, pp = 1 ZeRO-3)
            return [f"{tag_dir}: no DeepSpeed model-states files (an incomplete save)"]
        return [f"{p}: {why}" for p in sorted(files) if (why := file_problem(p))]
    try:
        world = int(json.loads((tag_dir / LAYOUT_FILE).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{tag_dir / LAYOUT_FILE}: unreadable ({err})"]
    problems = []
    for rank in range(world):
        listing = files_path(tag_dir, rank)
        try:
            files = json.loads(listing.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            problems.append(f"{listing}: missing or unreadable (rank {rank} did not finish its save)")
            continue
        for rel, size in sorted(files.items()):
            path = tag_dir / rel
            if not path.is_file():
                problems.append(f"{path}: missing")
            elif path.stat().st_size != size:
                problems.append(f"{path}: {path.stat().st_size} bytes, {size} when written (truncated?)")
            elif path.suffix == ".pt" and (why := file_problem(path)):
                problems.append(f"{path}: {why}")
    return problems


def _listed_format(listing: Path) -> int:
    try:
        return int(json.loads(listing.read_text()).get("format", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def check_complete(tag_dir: Path, key: str) -> None:
    """UserError naming the damaged files when a tag dsx3d wrote (one with file lists or a manifest) is
    incomplete or corrupt; a DeepSpeed tag written elsewhere passes unchecked here."""
    if not (has_manifest(tag_dir) or (tag_dir / FILES_DIR).is_dir()):
        return
    problems = tag_problems(tag_dir)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError.single(
            key,
            str(tag_dir),
            f"the checkpoint is incomplete or corrupt: {'; '.join(problems[:3])}{more}",
            "pick a complete tag (--tag; `dsx3d train --resume` falls back to one itself), or restore it from a copy",
        )


def choose_tag(ckpt_dir: Path) -> tuple[str | None, list[str]]:
    """The tag to resume: `latest` if it is complete, else the newest complete tag before it, with a note
    naming what was damaged. None when there is no `latest`. UserError when no tag is complete."""
    latest = read_latest(ckpt_dir)
    if latest is None:
        return None, []
    newest = step_of(latest)
    older = [t for t in reversed(step_tags(ckpt_dir)) if newest is not None and (step_of(t) or 0) < newest]
    damaged: list[tuple[str, list[str]]] = []
    for tag in [latest, *older]:
        problems = tag_problems(ckpt_dir / tag)
        if not problems:
            notes = [
                f"checkpoint {t} is damaged: {p[0]}"
                + (f" (and {len(p) - 1} more problems)" if len(p) > 1 else "")
                for t, p in damaged
            ]
            if damaged:
                notes.append(f"resuming from {tag} instead, the newest complete checkpoint before it")
            return tag, notes
        damaged.append((tag, problems))
    raise UserError(
        [
            Problem(
                str(ckpt_dir / tag),
                "(checkpoint)",
                f"damaged: {'; '.join(p[:3])}",
                "restore it from a copy, or start over with --overwrite",
            )
            for tag, p in damaged
        ]
    )


def set_aside_damaged(ckpt_dir: Path, chosen: str) -> list[str]:
    """Rename the damaged tags newer than `chosen` (up to `latest`) to `.damaged-<tag>`: kept for a look,
    but no longer counted by pruning, which would otherwise keep them and delete the complete tag the run
    resumed from (a resume from step 20 past a damaged step 23 saves step 24, and keeping two would mean
    23 and 24). Run by rank 0 before the ranks load; notes saying what moved."""
    latest = read_latest(ckpt_dir)
    low, high = step_of(chosen), step_of(latest) if latest else None
    if low is None or high is None:
        return []
    notes = []
    for tag in step_tags(ckpt_dir):
        step = step_of(tag)
        if step is not None and low < step <= high:
            target = ckpt_dir / f".damaged-{tag}"
            n = 1
            while target.exists():
                n += 1
                target = ckpt_dir / f".damaged-{tag}.{n}"
            (ckpt_dir / tag).rename(target)
            notes.append(f"moved the damaged {tag} aside to {target.name}")
    return notes


def resolve_tag_dir(path: Path, tag: str | None = None) -> Path:
    """A tag directory as is; a checkpoints directory through `tag` or its `latest` file."""
    if not path.is_dir():
        raise UserError.single(
            "CHECKPOINT_DIR",
            str(path),
            "not a directory",
            "pass OUTPUT_DIR/checkpoints or one of its tag directories",
        )
    if tag is None and is_tag_dir(path):
        check_complete(path, "CHECKPOINT_DIR")
        return path
    if tag is None:
        tag = read_latest(path)
        if tag is None:
            raise UserError.single(
                "CHECKPOINT_DIR",
                str(path),
                "neither a tag directory (DeepSpeed *model_states.pt files) nor a checkpoints directory with a `latest` file",
                "pass OUTPUT_DIR/checkpoints or one of its tag directories",
            )
    tag_dir = path / check_tag(tag, "--tag")
    if not is_tag_dir(tag_dir):
        raise UserError.single(
            "CHECKPOINT_DIR",
            str(tag_dir),
            "no DeepSpeed model-states files there",
            "pick a complete tag (see the `latest` file)",
        )
    check_complete(tag_dir, "CHECKPOINT_DIR")  # its manifest: every file's size and checksum as written
    return tag_dir
