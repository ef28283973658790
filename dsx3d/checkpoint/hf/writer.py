"""Writing a Hugging Face checkpoint directory tensor by tensor.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range) and the raw
bytes. When every name, shape and dtype is known up front, the header can be written first and the tensors
streamed after it one at a time, so a writer never holds more than the layer it is writing. Both exports
(the collective `export_hf` and the offline `dsx3d export`) plan their files with `plan_files` and write
them with `SafetensorsWriter`, into a staging directory that `publish` renames into place.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig

from dsx3d import fsio
from dsx3d.boundary_types import HFProcessor
from dsx3d.checkpoint.hf.reader import DTYPE_NAMES, SAFETENSORS_INDEX
from dsx3d.checkpoint.manifest import check_replaceable, write_manifest
from dsx3d.errors import UserError

DEFAULT_MAX_SHARD_SIZE = "5GB"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class Entry:
    """One tensor of the output, under its hub name."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


Group = list[Entry]
"""The tensors of one layer (or of the embedding, the final norm, the head): written together."""


@dataclass
class ShardFile:
    name: str
    groups: list[Group] = field(default_factory=list)
    segment: int = 0
    """Which writer writes it (a pipeline stage for export_hf; always 0 offline)."""

    @property
    def entries(self) -> list[Entry]:
        return [e for g in self.groups for e in g]


def parse_size(text: str | int) -> int:
    """'5GB' -> 5 * 10**9 bytes (HF's convention: decimal units; 'GiB' binary)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,15})?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m:
        raise UserError.single("--max-shard-size", text, "not a size", "write it like 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def plan_files(segments: list[list[Group]], max_shard_bytes: int) -> list[ShardFile]:
    """Pack groups into files of at most `max_shard_bytes` (a bigger group gets a file of its own); a file
    never spans two segments. Names follow save_pretrained: model-00001-of-0000N.safetensors."""
    files: list[ShardFile] = []
    for segment, groups in enumerate(segments):
        current: ShardFile | None = None
        size = 0
        for group in groups:
            nbytes = sum(e.nbytes for e in group)
            if current is None or (current.groups and size + nbytes > max_shard_bytes):
                current = ShardFile("", segment=segment)
                files.append(current)
                size = 0
            current.groups.append(group)
            size += nbytes
    for i, f in enumerate(files):
        f.name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    return files


class SafetensorsWriter:
    """Streams tensors into a safetensors file whose header is written first; the tensors must come in the
    planned order with the planned shapes and dtypes."""

    def __init__(self, path: Path, entries: list[Entry]):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for e in entries:
            header[e.name] = {
                "dtype": DTYPE_NAMES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path = path
        self._pending = deque(entries)
        self._f = open(path, "wb")
        self._f.write(len(blob).to_bytes(8, "little"))
        self._f.write(blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._pending.popleft()
        got = (name, tuple(tensor.shape), tensor.dtype)
        if got != (expected.name, expected.shape, expected.dtype):
            raise RuntimeError(f"{self.path.name}: planned {expected}, got {got}")
        if tensor.numel():
            self._f.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        if self._pending:
            raise RuntimeError(f"{self.path.name}: {len(self._pending)} planned tensors never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def write_index(out: Path, files: list[ShardFile]) -> None:
    entries = [(e, f.name) for f in files for e in f.entries]
    index = {
        "metadata": {
            "total_parameters": sum(e.numel for e, _ in entries),
            "total_size": sum(e.nbytes for e, _ in entries),
        },
        "weight_map": {e.name: name for e, name in sorted(entries, key=lambda x: x[0].name)},
    }
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=False) + "\n")


def write_configs(out: Path, config: PretrainedConfig, dtype: torch.dtype, architecture: str) -> None:
    """config.json with the saved dtype and the CausalLM class, and generation_config.json (the source
    checkpoint's own if the config came from a directory that has one)."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.architectures = [architecture]
    config.save_pretrained(out)
    source = Path(str(getattr(config, "_name_or_path", "") or ""))
    if source.is_dir() and (source / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(source)
    else:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(out)


def save_tokenizer(out: Path, tokenizer: HFProcessor | str | Path | None) -> bool:
    """A tokenizer object (save_pretrained) or a directory holding tokenizer files (copied)."""
    if tokenizer is None:
        return False
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
        return True
    return copy_tokenizer_files(Path(tokenizer), out)


def copy_tokenizer_files(source: Path, out: Path) -> bool:
    found = [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    for f in found:
        shutil.copy2(f, out / f.name)
    return bool(found)


def staging_dir(out: Path) -> Path:
    """A fresh directory next to `out` (same filesystem, so publishing is a rename). Refuses to replace
    anything but a previous dsx3d export (its dsx3d_export.json names every file there) or an empty
    directory: a source model or any other directory is never replaced."""
    check_replaceable(out, "export", "OUT_DIR")
    return fsio.staging_dir(out)


def publish(staging: Path, out: Path) -> None:
    """Name every file of the finished staging directory in its manifest, then move it to `out` (files
    0644, directories 0755), replacing the previous export there (checked again: nothing may have
    appeared in it meanwhile)."""
    write_manifest(staging, "export")
    check_replaceable(out, "export", "OUT_DIR")
    fsio.publish_dir(staging, out)
