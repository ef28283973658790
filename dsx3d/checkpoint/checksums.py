"""Verified manifests: every file's size and xxh3 checksum, written last and atomically, checked before a load.

A training-checkpoint tag carries `dsx3d_checkpoint.json` (kind "checkpoint" of dsx3d.checkpoint.manifest,
so its "files" list is read like any other dsx3d manifest), with `"hash": "xxh3_64"`,
`"sums": {path: [size, hex digest]}` and `"self"`: the checksum of the rest of the manifest. Each rank computes the sums of the files it writes, in its own process:
DeepSpeed's torch.save writes through a hashing file (`save_hashed`), other files are read back once; rank 0 writes the manifest once every rank's
files are written, and only then moves `latest`. A tag whose manifest is missing was never completed; a file
whose size or checksum differs from its manifest entry is truncated or corrupt, and is named.

xxh3_64 (the xxhash package, which datasets already needs) hashes about 15 GB/s on one core, six times zlib's
CRC-32 here, so reading a file back from the page cache costs more than hashing it. A 64-bit checksum misses
a random corruption with probability 2^-64; it is no defence against a forger (the weights-only load is:
dsx3d.checkpoint.safe_load).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import xxhash

from dsx3d.checkpoint.manifest import manifest_path
from dsx3d.fsio import write_atomic

KIND = "checkpoint"
HASH = "xxh3_64"
SELF = "self"
"""The manifest's checksum of its own content: a flipped bit anywhere in it (its file list included) is found."""
_KEYS = ({"kind", "hash", "files", "sums"}, {"kind", "hash", "files", "sums", SELF})
"""A manifest's keys; without SELF: written before manifests checked themselves."""
_CHUNK = 1 << 22


def digest(path: Path) -> tuple[int, str]:
    """(size in bytes, xxh3_64 hex digest) of a file, read in 4 MiB chunks."""
    h, size = xxhash.xxh3_64(), 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class _HashingWriter:
    """A write-only binary file that hashes what passes through it (torch.save writes its zip through it)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.h, self.size = f, xxhash.xxh3_64(), 0

    def write(self, data: Any) -> int:
        self.h.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_hashed(save: Callable[[Any], None], path: Path) -> tuple[int, str]:
    """Write `path` with `save(file)` and return its (size, digest) as `digest` would, without reading it back."""
    with path.open("wb") as f:
        writer = _HashingWriter(f)
        save(writer)
    return writer.size, writer.h.hexdigest()


def write_sums(directory: Path, sums: dict[str, tuple[int, str]], kind: str = KIND) -> Path:
    """Write the manifest of `directory` naming `sums` (relative POSIX path -> (size, digest)), atomically."""
    data: dict[str, Any] = {
        "kind": kind,
        "hash": HASH,
        "files": sorted(sums),
        "sums": {rel: [int(size), str(h)] for rel, (size, h) in sorted(sums.items())},
    }
    data[SELF] = _own_sum(data)
    # Atomic (renamed into place) but not fsynced, like DeepSpeed's own files: `latest`, written next with an
    # fsync, may outlive it in a power cut, and then --resume finds the tag incomplete and falls back.
    return write_atomic(manifest_path(directory, kind), json.dumps(data, indent=1) + "\n", fsync=False)


def _own_sum(data: dict[str, Any]) -> str:
    """The checksum of the manifest's own content (every key but SELF, in a canonical form)."""
    rest = {k: v for k, v in data.items() if k != SELF}
    return str(xxhash.xxh3_64(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest())


def _read(directory: Path, kind: str) -> tuple[dict[str, tuple[int, str]] | None, str]:
    """(the sums, "") or (None, why not): missing, unreadable, or corrupt (its own checksum differs)."""
    path = manifest_path(directory, kind)
    if not path.exists():
        return None, "missing (the save did not finish)"
    try:
        data = json.loads(path.read_text())
        sums = data["sums"]
        if data.get("kind") != kind or data.get("hash") != HASH or not isinstance(sums, dict):
            return None, "unreadable"
        if set(data) not in _KEYS:  # a flipped bit in a key name
            return None, "corrupt (unknown keys)"
        if SELF in data and data[SELF] != _own_sum(data):
            return None, "corrupt (its own checksum differs from the one recorded when it was written)"
        return {str(rel): (int(v[0]), str(v[1])) for rel, v in sums.items()}, ""
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None, "unreadable"


def read_sums(directory: Path, kind: str = KIND) -> dict[str, tuple[int, str]] | None:
    """The manifest's sums, or None when there is no readable, intact manifest with sums of a hash known here."""
    return _read(directory, kind)[0]


def has_manifest(directory: Path, kind: str = KIND) -> bool:
    return manifest_path(directory, kind).exists()


def sum_problems(directory: Path, kind: str = KIND, *, checksums: bool = True) -> list[str]:
    """What does not match the manifest ('path: reason'); empty when every file has its recorded size and
    (with `checksums`) checksum. A missing or unreadable manifest is one problem."""
    sums, why = _read(directory, kind)
    if sums is None:
        return [f"{manifest_path(directory, kind)}: {why}"]
    problems = []
    for rel, (size, want) in sorted(sums.items()):
        path = directory / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"{manifest_path(directory, kind)}: names a path outside the tag ({rel[:80]})")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{path}: {path.stat().st_size} bytes, {size} when written (truncated?)")
        elif checksums and digest(path)[1] != want:
            problems.append(f"{path}: its checksum differs from the one recorded when it was written (corrupt)")
    return problems
