"""What a Hugging Face checkpoint directory holds, and reading one tensor's slice from disk.

Formats: `model.safetensors[.index.json]` (preferred) and `pytorch_model.bin[.index.json]`. Nothing here
executes code from the checkpoint: safetensors is raw bytes plus a JSON header, and .bin files are read only
with `torch.load(weights_only=True)`.

safetensors are read without `safe_open`'s memory map: the header is parsed once per file and the data is
read with positional reads into the result. A slice along dim 0 is one contiguous read; a slice along a later
dim is read segment by segment (or in blocks of whole rows when segments are small), so a rank's memory grows
by its own slice plus at most one block, and file pages stay in the page cache rather than in the process's
resident set. (`safe_open(...).get_slice(name)[:, a:b]` returns a view of the mapped tensor: copying it
touches every page of the full tensor, and an open handle keeps those pages resident.)
"""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsx3d.errors import Problem, UserError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

READ_BLOCK_BYTES = 1 << 20
"""Most bytes read at once for a strided slice whose segments are too small to read one by one."""
_MIN_SEGMENT_BYTES = 512
"""Segments at least this long are read one by one straight into the result: more system calls (one per
row), but no temporary buffer, whose allocation and release would fragment the heap and keep RSS above
the shard after loading."""
_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit

_FIX_INCOMPLETE = "copy or download the checkpoint again; every file named by the index must be complete"


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives. `offset` is the absolute byte offset of its data in a safetensors file, or -1
    for a .bin file."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = -1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo from a safetensors header; ValueError (with the reason) if the file is truncated
    or not a safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"only {size} bytes: not a safetensors file (truncated?)")
        header_len = int.from_bytes(head, "little")
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"its header claims {header_len} bytes but the file has {size}: truncated")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:
            raise ValueError(f"unreadable header ({err})") from None
    data_start = 8 + header_len
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name} has an unknown dtype {entry.get('dtype')!r}")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        info = TensorInfo(path, shape, dtype, data_start + begin)
        if end - begin != info.nbytes:
            raise ValueError(f"tensor {name}: {end - begin} bytes for shape {shape} {entry['dtype']}")
        if data_start + end > size:
            raise ValueError(
                f"tensor {name} ends at byte {data_start + end} but the file has {size}: truncated"
            )
        infos[name] = info
    return infos


def load_bin(path: Path) -> dict[str, Any]:
    """A .bin state dict through `torch.load(weights_only=True)` (memory-mapped when the file allows):
    the restricted unpickler refuses anything but tensors and plain containers, so no code runs."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # legacy non-zip format: read it all


def _bin_problem(path: Path, err: Exception) -> Problem:
    if isinstance(err, pickle.UnpicklingError):
        return Problem(
            str(path),
            "(pickle)",
            "holds objects other than tensors, which dsx3d refuses to unpickle (it reads .bin files only with "
            "torch.load(weights_only=True) and never runs code from a checkpoint)",
            "convert the checkpoint to safetensors with a trusted tool, then point model.name_or_path at it",
        )
    return Problem(
        str(path), "(file)", f"unreadable ({type(err).__name__}: {str(err)[:200]})", _FIX_INCOMPLETE
    )


class CheckpointFiles:
    """Every tensor of a checkpoint directory (name -> TensorInfo) and every problem found reading the
    index and the headers. Only headers are read here; `read` fetches one tensor's slice."""

    def __init__(self, root: Path):
        self.root = root
        self.tensors: dict[str, TensorInfo] = {}
        self.problems: list[Problem] = []
        self.index_file: Path | None = None
        self.lost: set[str] = set()
        """Tensors the index places in a file that is missing or unreadable (already reported per file)."""
        self._bin_cache: tuple[Path, dict[str, Any]] | None = None
        self._scan()

    # -- scanning ------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        for index_name, single_name in ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE), (BIN_INDEX, BIN_SINGLE)):
            if (self.root / index_name).is_file():
                self.index_file = self.root / index_name
                self._scan_files(self._read_index(self.index_file))
                return
            if (self.root / single_name).is_file():
                self._scan_files({single_name: None})
                return
        present = sorted(
            p.name
            for p in self.root.iterdir()
            if p.suffix in {".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".gguf", ".h5", ".msgpack"}
        )
        self.problems.append(
            Problem(
                "model.name_or_path",
                str(self.root),
                f"no {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, {BIN_SINGLE} or {BIN_INDEX} there"
                + (f" (found {', '.join(present[:5])}: not a format dsx3d reads)" if present else ""),
                "point it at a Hugging Face checkpoint directory (save_pretrained output)",
            )
        )

    def _read_index(self, index: Path) -> dict[str, list[str] | None]:
        """file name -> tensor names the index places in it."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            self.problems.append(
                Problem(str(index), "weight_map", f"unreadable index ({err})", _FIX_INCOMPLETE)
            )
            return {}
        files: dict[str, list[str] | None] = {}
        for name, file_name in weight_map.items():
            files.setdefault(file_name, []).append(name)  # type: ignore[union-attr]
        return files

    def _scan_files(self, files: dict[str, list[str] | None]) -> None:
        for file_name, indexed in files.items():
            path = self.root / file_name
            if Path(file_name).is_absolute() or ".." in Path(file_name).parts:
                self.problems.append(
                    Problem(
                        str(self.index_file),
                        file_name,
                        "the index points outside the checkpoint directory",
                        _FIX_INCOMPLETE,
                    )
                )
                continue
            if not path.is_file():
                names = indexed or []
                self.lost.update(names)
                self.problems.append(
                    Problem(
                        str(path),
                        f"{len(names)} tensors, e.g. {names[0]}" if names else "(file)",
                        f"listed in {self.index_file.name if self.index_file else 'the index'} but missing",
                        _FIX_INCOMPLETE,
                    )
                )
                continue
            try:
                infos = self._header(path)
            except (ValueError, OSError, RuntimeError, pickle.UnpicklingError) as err:
                self.lost.update(indexed or [])
                if path.suffix == ".bin":
                    self.problems.append(_bin_problem(path, err))
                else:
                    self.problems.append(Problem(str(path), "(header)", str(err), _FIX_INCOMPLETE))
                continue
            for name in indexed or []:
                if name not in infos:
                    self.problems.append(
                        Problem(
                            str(path),
                            name,
                            "the index places this tensor here but the file lacks it",
                            _FIX_INCOMPLETE,
                        )
                    )
            for name, info in infos.items():
                if name in self.tensors:
                    self.problems.append(
                        Problem(
                            str(path), name, f"also stored in {self.tensors[name].file.name}", _FIX_INCOMPLETE
                        )
                    )
                self.tensors[name] = info

    def _header(self, path: Path) -> dict[str, TensorInfo]:
        if path.suffix == ".safetensors":
            return read_safetensors_header(path)
        infos = {}
        for name, value in load_bin(path).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"entry {name} is a {type(value).__name__}, not a tensor")
            infos[name] = TensorInfo(path, tuple(value.shape), value.dtype)
        return infos

    # -- reading -------------------------------------------------------------------------------------------

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int = 0,
        stop: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The [start, stop) slice of tensor `name` along `dim` (clipped to its size), or all of it, in
        `dtype` (default: the file's), in a buffer of its own."""
        info = self.tensors[name]
        if dim is None or not info.shape:
            dim, start, stop = 0, 0, None
        n = info.shape[dim] if info.shape else 1
        start = min(start, n)
        stop = max(start, n if stop is None else min(stop, n))
        if info.offset < 0:
            t = self._bin(info.file)[name]
            t = t.narrow(dim, start, stop - start) if info.shape else t
            return t.to(dtype or t.dtype, copy=True)  # not a view of the memory-mapped file
        return self._read_safetensors_slice(info, dim, start, stop, dtype or info.dtype)

    def _read_safetensors_slice(
        self, info: TensorInfo, dim: int, start: int, stop: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """View the tensor as (outer, n, inner) and read [:, start:stop] as runs of contiguous elements:
        one run when outer == 1 (or the whole tensor), else one run per row segment."""
        shape, itemsize = info.shape, info.dtype.itemsize
        outer, n, inner = math.prod(shape[:dim]), (shape[dim] if shape else 1), math.prod(shape[dim + 1 :])
        length = (stop - start) * inner  # elements per segment
        out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1 :]), dtype=dtype)
        if out.numel() == 0:
            return out
        with open(info.file, "rb", buffering=0) as f:
            if outer == 1 or (start == 0 and stop == n):
                runs = [(info.offset + start * inner * itemsize, 0, out.numel())]
            elif length * itemsize >= _MIN_SEGMENT_BYTES:
                runs = [
                    (info.offset + (o * n + start) * inner * itemsize, o * length, length)
                    for o in range(outer)
                ]
            else:  # small segments: whole rows in blocks, then keep the columns we own (converting on the copy)
                rows = out.view(outer, stop - start, inner)
                per_block = max(1, READ_BLOCK_BYTES // (n * inner * itemsize))
                block = torch.empty((min(per_block, outer), n, inner), dtype=info.dtype)
                for o in range(0, outer, per_block):
                    k = min(per_block, outer - o)
                    _read_into(f, info.offset + o * n * inner * itemsize, _bytes_of(block[:k]), info.file)
                    rows[o : o + k].copy_(block[:k, start:stop])
                return out
            flat = out.view(-1)
            if dtype == info.dtype:  # straight into the result
                for src, dst, count in runs:
                    _read_into(f, src, _bytes_of(flat[dst : dst + count]), info.file)
                return out
            # another dtype: through a small buffer, so no full-size copy in the file's dtype ever exists
            buf = torch.empty(min(max(r[2] for r in runs), READ_BLOCK_BYTES // itemsize), dtype=info.dtype)
            for src, dst, count in runs:
                for k0 in range(0, count, len(buf)):
                    k = min(len(buf), count - k0)
                    _read_into(f, src + k0 * itemsize, _bytes_of(buf[:k]), info.file)
                    flat[dst + k0 : dst + k0 + k].copy_(buf[:k])
        return out

    def _bin(self, path: Path) -> dict[str, Any]:
        """One .bin file at a time stays loaded (memory-mapped when possible)."""
        if self._bin_cache is None or self._bin_cache[0] != path:
            self._bin_cache = None
            self._bin_cache = (path, load_bin(path))
        return self._bin_cache[1]

    def release(self) -> None:
        self._bin_cache = None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's storage."""
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _read_into(f: Any, offset: int, dest: memoryview, path: Path) -> None:
    f.seek(offset)
    done = 0
    while done < len(dest):
        got = f.readinto(dest[done:])
        if not got:
            raise UserError.single(
                str(path),
                f"byte {offset + done}",
                "the file ended early (truncated while loading?)",
                _FIX_INCOMPLETE,
            )
        done += got
