"""Loading checkpoint files without running code from them.

A checkpoint is data somebody may hand you. `torch.load(weights_only=False)` unpickles arbitrary objects,
and a pickle can call any function while it loads. dsx3d reads its own files with `weights_only=True`;
DeepSpeed's load paths that dsx3d drives (engine.load_checkpoint: model, optimizer and ZeRO states; the
universal converter ds_to_universal; universal loading) pass weights_only=False, so they run inside
`weights_only_loads()`, which makes every torch.load weights-only. DeepSpeed's files hold four classes of
its own besides tensors and plain containers (measured with torch.serialization.
get_unsafe_globals_in_checkpoint on fp32 and bf16, ZeRO-0/1 checkpoints and their universal conversions);
those, and only those, are allowed. A file holding anything else is refused, naming the file and the
object, and nothing in it runs.
"""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dsx3d.errors import Problem, UserError

_FIX = (
    "resume from a checkpoint written by dsx3d (or DeepSpeed) that nobody altered; never load checkpoints from "
    "sources you do not trust"
)


def deepspeed_globals() -> list[Any]:
    """The DeepSpeed classes its checkpoint files hold (loss scaler, enum, fragment address namedtuple)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def allowed_global_names() -> set[str]:
    return {f"{g.__module__}.{g.__qualname__}" for g in deepspeed_globals()}


class UnsafeCheckpoint(UserError):
    """A checkpoint file holds pickled objects that a weights-only load refuses."""

    def __init__(self, path: str, detail: str):
        super().__init__(
            Problem(
                path,
                "(pickle)",
                f"holds objects that are not tensors or DeepSpeed's plain state ({detail}); dsx3d loads "
                "checkpoints only with torch.load(weights_only=True) and never runs code from them",
                _FIX,
            )
        )


def _name(f: object) -> str:
    return str(f) if isinstance(f, (str, Path)) else getattr(f, "name", repr(f))


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """torch.load with weights_only=True and DeepSpeed's classes allowed; UnsafeCheckpoint on refusal."""
    kwargs.pop("weights_only", None)
    if kwargs.pop("pickle_module", None) is not None:
        raise UnsafeCheckpoint(_name(f), "a custom unpickler was requested")
    with torch.serialization.safe_globals(deepspeed_globals()):
        try:
            return _ORIGINAL_LOAD(f, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(_name(f), _first_line(err)) from None


_ORIGINAL_LOAD = torch.load


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within the block every `torch.load` (DeepSpeed's included, whatever weights_only it passes) is
    `load` above. Not thread-safe: dsx3d loads checkpoints from the main thread."""
    previous = torch.load
    torch.load = load  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = previous  # type: ignore[assignment]


def file_problem(path: Path) -> str | None:
    """Why the torch checkpoint file at `path` cannot be loaded safely (None when it can), without loading
    it: the zip container must be intact (a truncated file loses its central directory) and its pickle may
    name no class beyond the allowed ones (read from the opcodes; nothing is executed)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile) as err:
        return f"not an intact torch checkpoint ({_first_line(err)}; truncated?)"
    if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        return "not a torch checkpoint (no data.pkl inside)"
    try:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception as err:  # a damaged pickle stream
        return f"unreadable pickle ({type(err).__name__}: {_first_line(err)})"
    refused = sorted(unsafe - allowed_global_names())
    if refused:
        return f"its pickle names {', '.join(refused[:3])}, which a weights-only load refuses (code could run)"
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__
