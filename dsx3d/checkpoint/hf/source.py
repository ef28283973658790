"""A `WeightSource` over a local Hugging Face checkpoint: each rank reads only the slices it owns.

The engine builds every stage on the meta device and asks its source for [start, stop) of each tensor along
the tensor's TP dim (dsx3d.models.weights.materialize). Before any of that, `checkpoint_source` reads the
index and every file header and checks the whole name set against the model, so a missing, truncated or
mismatched checkpoint stops with one `UserError` that lists every problem, naming file and tensor.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from dsx3d.checkpoint.hf.names import FusedGroup, LoadPlan, meta_model, plan_load
from dsx3d.checkpoint.hf.reader import CheckpointFiles
from dsx3d.errors import UserError
from dsx3d.models.weights import slice_along

log = logging.getLogger("dsx3d")


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def expert_subset(group: FusedGroup, start: int, stop: int) -> FusedGroup | None:
    """The part of a fusion that stacks per-expert checkpoint tensors (`mlp.experts.<i>.w1.weight` ...)
    which produces experts [start, stop) of its outputs: the same converter over those experts' tensors
    only. None when the fusion is not a stack of experts 0..E-1."""
    indices = [_EXPERT_INDEX.search(key) for _, key in group.sources]
    if not indices or any(m is None for m in indices):
        return None
    numbers = [int(m.group(1)) for m in indices if m is not None]
    if sorted(set(numbers)) != list(range(max(numbers) + 1)):
        return None
    kept = [src for src, i in zip(group.sources, numbers, strict=True) if start <= i < stop]
    return FusedGroup(group.converter, group.first, kept, list(group.targets))


class CheckpointSource:
    """Slices of a verified checkpoint. Renamed tensors are read under their checkpoint names; fused ones
    (MoE experts) are assembled by transformers' converter from the per-expert tensors of the experts asked
    for (a rank holding experts [a, b) reads only those), or whole and then sliced. Every tensor returned
    owns a buffer of exactly its size (`fresh_tensors`): parameters adopt it without a copy."""

    fresh_tensors = True

    def __init__(
        self, files: CheckpointFiles, plan: LoadPlan, model: Any, dtype: torch.dtype | None = torch.float32
    ):
        self.files, self.plan, self.model = files, plan, model
        self.dtype = dtype
        """What tensors are converted to while they are read (the stages build fp32 parameters; DeepSpeed
        casts for bf16 runs): reading a bf16 file into fp32 parameters then needs no bf16 copy in between."""
        self._pending: dict[tuple[str, int, int | None], torch.Tensor] = {}
        """Other outputs of a fusion (by name and expert range), until their turn comes."""

    def has(self, name: str) -> bool:
        return self.plan.provides(name)

    def load(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        if name in self.plan.direct:
            return self.files.read(self.plan.direct[name], dim, start, stop, self.dtype)
        if name in self.plan.buffers:
            return self.files.read(self.plan.buffers[name], dim, start, stop, self.dtype)
        group = self.plan.fused[name]
        if dim == 0 and stop is not None:
            subset = expert_subset(group, start, stop)
            if subset is not None:
                return self._fused(name, subset, (start, stop)).clone()
        # converter outputs may be views of a bigger tensor: clone the slice
        return slice_along(self._fused(name, group, (0, None)), dim, start, stop).clone()

    def _fused(self, name: str, group: FusedGroup, experts: tuple[int, int | None]) -> torch.Tensor:
        if (name, *experts) not in self._pending:
            produced = group.convert(self.model, lambda key: self.files.read(key, dtype=self.dtype))
            self._pending.update({(target, *experts): t for target, t in produced.items()})
        return self._pending.pop((name, *experts))

    def release(self) -> None:
        """Drop what is still held (a memory-mapped .bin file, unclaimed fusion outputs)."""
        self.files.release()
        self._pending.clear()


def resolve_checkpoint_dir(path: str) -> Path:
    """A local directory as is; otherwise a hub id already in the local Hugging Face cache (no download)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=path, local_files_only=True))
    except Exception:  # not a repo id, or not cached: both mean "nothing to read here"
        raise UserError.single(
            "model.name_or_path",
            path,
            "not a local directory, nor a hub id in the local Hugging Face cache",
            "point it at a checkpoint directory written by save_pretrained (or download it first)",
        ) from None


def checkpoint_source(
    path: str,
    hf_config: PretrainedConfig | None = None,
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = torch.float32,
) -> CheckpointSource:
    """Verify the checkpoint at `path` against the model of `hf_config` (default: its own config.json)
    and return its source; raise `UserError` with every problem found. Reads headers only. Tensors are
    read as `dtype` (None: as stored)."""
    root = resolve_checkpoint_dir(path)
    if hf_config is None:
        hf_config = AutoConfig.from_pretrained(str(root), trust_remote_code=trust_remote_code)
    files = CheckpointFiles(root)
    model = meta_model(hf_config)
    plan = plan_load(files.tensors, model, hf_config, str(files.index_file or root), files.lost)
    problems = files.problems + plan.problems
    if problems:
        raise UserError(problems)
    if plan.ignored:
        log.info(
            "checkpoint %s: not loading %d tied aliases (%s)",
            root,
            len(plan.ignored),
            ", ".join(plan.ignored[:3]),
        )
    return CheckpointSource(files, plan, model, dtype)
