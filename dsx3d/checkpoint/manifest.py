"""What dsx3d wrote into a directory, so that it only ever deletes or replaces its own files.

A manifest is a small JSON file in the directory it describes, `{"kind": ..., "files": [relative paths]}`.
A Hugging Face export (kind "export", `dsx3d_export.json`), a universal checkpoint ("universal") and a run
directory ("run", `dsx3d_run.json`) carry one. Before dsx3d replaces or clears such a directory it lists
the files there that the manifest does not name; if there is any, it refuses and names them. A directory
without a manifest is somebody else's (a source model, a user's notes) and is never replaced.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from dsx3d.errors import UserError
from dsx3d.fsio import write_atomic

MANIFESTS = {
    "export": "dsx3d_export.json",
    "universal": "dsx3d_universal.json",
    "run": "dsx3d_run.json",
    "checkpoint": "dsx3d_checkpoint.json",  # a training-checkpoint tag, with sizes and checksums: dsx3d.checkpoint.checksums
}
SHOWN = 8
"""Unknown files named in an error message (then a count)."""


def manifest_path(directory: Path, kind: str) -> Path:
    return directory / MANIFESTS[kind]


def files_under(directory: Path) -> list[str]:
    """Every file (and symlink) below `directory`, as sorted relative POSIX paths; directories are not listed."""
    if not directory.is_dir():
        return []
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_symlink() or not p.is_dir())


def read_manifest(directory: Path, kind: str) -> set[str] | None:
    """The files the manifest of `kind` names, or None when there is no readable manifest of that kind."""
    path = manifest_path(directory, kind)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("kind") != kind or not isinstance(data.get("files"), list):
        return None
    return {f for f in data["files"] if isinstance(f, str)}


def write_manifest(directory: Path, kind: str, files: Iterable[str] | None = None) -> None:
    """Name `files` (default: everything now below `directory`) as written by dsx3d."""
    name = MANIFESTS[kind]
    listed = sorted({f for f in (files if files is not None else files_under(directory)) if f != name})
    write_atomic(manifest_path(directory, kind), json.dumps({"kind": kind, "files": listed}, indent=1) + "\n")


def record(directory: Path, kind: str, files: Iterable[str]) -> None:
    """Add `files` to the manifest (creating it)."""
    write_manifest(directory, kind, (read_manifest(directory, kind) or set()) | set(files))


def unknown_files(directory: Path, kind: str) -> list[str]:
    """Files below `directory` that its manifest of `kind` does not name (all of them without one)."""
    known = read_manifest(directory, kind) or set()
    name = MANIFESTS[kind]
    return [f for f in files_under(directory) if f != name and f not in known]


def describe(paths: list[str]) -> str:
    shown = ", ".join(paths[:SHOWN])
    return shown + (f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else "")


def check_replaceable(directory: Path, kind: str, key: str) -> None:
    """Raise a UserError unless `directory` is absent, empty, or holds only files its manifest names."""
    if not directory.exists() and not directory.is_symlink():
        return
    if directory.is_symlink() or not directory.is_dir():
        raise UserError.single(key, str(directory), "exists and is not a directory", "choose a new directory")
    unknown = unknown_files(directory, kind)
    if unknown:
        what = "a previous dsx3d export" if kind == "export" else f"a dsx3d {kind} directory"
        raise UserError.single(
            key,
            str(directory),
            f"is not {what} (it holds files dsx3d did not write: {describe(unknown)}), so it will not be replaced",
            "choose a new or empty directory",
        )
