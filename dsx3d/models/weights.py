"""Filling a meta-device stage with real tensors: each rank reads only the rows/columns it owns.

A `WeightSource` answers `load(name, dim, start, stop)` with the [start, stop) slice of the named HF tensor
along `dim` (or the whole tensor when dim is None). Sources: an in-memory state dict (tests, `dsx3d verify`,
fresh initialisation) and, in dsx3d.checkpoint, safetensors files read slice by slice.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from dsx3d.errors import UserError

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """`fresh_tensors = True` on a source promises that `load` returns tensors owning exactly their own
    storage (no views of something bigger or shared), which parameters may then adopt without a copy."""

    def load(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


class StateDictSource:
    """Slices of an in-memory state dict (full tensors on every rank: only for models that fit in memory)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict = state_dict

    def has(self, name: str) -> bool:
        return name in self.state_dict

    def load(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return slice_along(self.state_dict[name], dim, start, stop)


def slice_along(tensor: torch.Tensor, dim: int | None, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """[start, stop) of `tensor` along `dim`, cut at its end (the caller zero-pads vocab rows past it);
    the whole tensor when dim is None."""
    if dim is None:
        return tensor
    stop = tensor.shape[dim] if stop is None else min(stop, tensor.shape[dim])
    start = min(start, stop)
    return tensor.narrow(dim, start, stop - start)


def _padded(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """Zero rows past the real vocabulary (vocab padded to a multiple of tp)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


SHARD_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shard_slot", "allreduce", "group_name")
"""What a sharded parameter carries: DeepSpeed's TP marks, dsx3d's expert slot, DeepSpeed's MoE marks."""

BUFFER_NAMES = "_dsx3d_buffer_hf_names"
"""The attribute of a module that maps its persistent buffers to their HF names (set by `materialize`; on
the module, not the tensor, because casts and moves replace a buffer's tensor)."""


def shard_of(param: torch.Tensor, tp_rank: int) -> tuple[int, int] | None:
    """(dim, index) of a parameter that holds piece `index` of equal pieces of the full tensor along `dim`:
    an expert shard's slot (`shard_slot`, over ep x tp), a TP shard's TP rank; None for a whole tensor."""
    dim = getattr(param, "partition_dim", None)
    if dim is None:
        return None
    if hasattr(param, "shard_slot"):
        return dim, param.shard_slot  # type: ignore[attr-defined]
    return (dim, tp_rank) if getattr(param, "tensor_model_parallel", False) else None


def materialize(module: nn.Module, prefix: str, source: WeightSource, tp_rank: int, aliases: dict[str, str] | None = None) -> None:
    """Replace every meta parameter of `module` with its shard read from `source` under `prefix + name`.

    A sharded parameter (`shard_of`: piece i of length n along its dim) takes rows [i * n, (i + 1) * n) of
    the full tensor, zero-padded past its end (vocab padding).
    """
    aliases = aliases or {}
    for sub_name, sub in module.named_modules():
        for pname, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            full = f"{prefix}{sub_name}.{pname}" if sub_name else f"{prefix}{pname}"
            name = aliases.get(full, full)
            if not source.has(name):
                raise UserError.single("model", name, "the weights lack this tensor", "check that the checkpoint matches the config")
            shard = shard_of(param, tp_rank)
            if shard is not None:
                dim, index = shard
                n = param.shape[dim]
                tensor = _padded(source.load(name, dim, index * n, (index + 1) * n), dim, n)
            else:
                tensor = source.load(name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise UserError.single(
                    "model", name, f"shape {tuple(tensor.shape)} does not match the expected {tuple(param.shape)}",
                    "check that the checkpoint matches the config",
                )
            # one copy at most; none when the source hands over fresh buffers (a second buffer per tensor,
            # freed right away, fragments the heap)
            data = tensor.detach().to(param.dtype, copy=not getattr(source, "fresh_tensors", False))
            new = nn.Parameter(data, requires_grad=param.requires_grad)
            new.hf_name = name  # type: ignore[attr-defined]
            for attr in SHARD_ATTRS:
                if hasattr(param, attr):
                    setattr(new, attr, getattr(param, attr))
            sub._parameters[pname] = new
        _load_buffers(sub, f"{prefix}{sub_name}." if sub_name else prefix, source)


def _load_buffers(module: nn.Module, prefix: str, source: WeightSource) -> None:
    """The persistent buffers of `module` itself that `source` holds, over the values the module computed, as
    `from_pretrained` does (a checkpoint's trained router bias; MiniMax's decays as saved, in bf16 when saved
    so). A buffer of another shape than the module's (one its layout changed) keeps the computed value."""
    for bname, buf in list(module._buffers.items()):
        name = f"{prefix}{bname}"
        if buf is None or bname in module._non_persistent_buffers_set:
            continue
        module.__dict__.setdefault(BUFFER_NAMES, {})[bname] = name  # what the HF export writes it as
        if buf.is_meta or not source.has(name):
            continue
        tensor = source.load(name)
        if tuple(tensor.shape) != tuple(buf.shape):
            log.warning("%s: the weights hold shape %s, the model %s: keeping the computed value", name, tuple(tensor.shape), tuple(buf.shape))
            continue
        module._buffers[bname] = tensor.detach().to(buf.dtype, copy=not getattr(source, "fresh_tensors", False))


def persistent_buffers(module: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """{key in `module.state_dict()`: (HF name, tensor)} of the persistent buffers `materialize` named, as
    `save_pretrained` writes them (a router's `e_score_correction_bias`, Gemma 4's `layer_scalar`)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for sub_name, sub in module.named_modules():
        for bname, hf_name in sub.__dict__.get(BUFFER_NAMES, {}).items():
            buf = sub._buffers.get(bname)
            if buf is not None and bname not in sub._non_persistent_buffers_set:
                out[f"{sub_name}.{bname}" if sub_name else bname] = (hf_name, buf)
    return out
