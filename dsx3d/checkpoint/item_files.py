"""Where each pipeline item's tensors lie in a DeepSpeed training checkpoint, for each engine's format.

Pipeline items are [embedding, decoder 0 .. L-1, final norm, head] (dsx3d.checkpoint.offline). Both engines
name parameters alike ("3.layer.mlp.up_proj.weight", "tied_modules.embed.embed.weight"), but store them
differently:

- pipeline (parallel.pp > 1): one file per item and TP rank, `layer_XX-model_YY-model_states.pt`, keys
  relative to the item;
- no pipeline, ZeRO-0/1/2: the whole module of TP rank YY in `mp_rank_YY_model_states.pt` (key "module"),
  keys prefixed by the item ("3." or "tied_modules.embed.");
- no pipeline, ZeRO-3: the module there is empty placeholders; the fp32 weights are partitioned over the dp
  ranks in `zero_pp_rank_D_mp_rank_YY_optim_states.pt` (`fp32_flat_groups`, one flat tensor per optimizer
  param group). Each parameter of `param_shapes` (in `zero_pp_rank_0_mp_rank_YY_model_states.pt`, same
  order) is split alone: ceil(numel / dp) elements per rank, the last zero-padded, laid end to end in its
  group's flat tensor. Reading a parameter takes its slice from each rank's file (memory-mapped) and
  concatenates them.

Every file is read with torch.load(weights_only=True); ZeRO-3 optimizer files also hold two plain
DeepSpeed records (the ZeRO stage enum and the loss-scaler state), which are allowed by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsx3d.checkpoint.files import load_bin

TIED_PREFIX = "tied_modules.embed."
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$")

Reader = Callable[[Path, int], dict[str, Any]]
"""(file, item index) -> that item's tensors, keyed relative to the item ("layer.mlp.up_proj.weight")."""


@dataclass(frozen=True)
class ItemFiles:
    """A tag's files by pipeline item and TP rank, and how to read one item from its file."""

    kind: str
    files: dict[int, dict[int, Path]]
    """item -> TP rank -> file; a file of the non-pipeline formats holds every item of its TP rank."""
    read: Reader
    file_name: Callable[[int, int], str]
    """The file expected for (item, TP rank): what a missing one is called."""


def layer_files(tag_dir: Path) -> dict[int, dict[int, Path]]:
    """Pipeline layer files: item -> TP rank -> file."""
    out: dict[int, dict[int, Path]] = {}
    if tag_dir.is_dir():
        for p in tag_dir.iterdir():
            m = _LAYER_FILE.match(p.name)
            if m:
                out.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    return out


def _tp_files(tag_dir: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    return (
        {int(m.group(1)): p for p in tag_dir.iterdir() if (m := pattern.match(p.name))}
        if tag_dir.is_dir()
        else {}
    )


def is_tag_dir(path: Path) -> bool:
    """Whether `path` holds a checkpoint of either engine (not the checkpoints directory above them)."""
    return bool(layer_files(path) or _tp_files(path, _MODEL_STATES) or _tp_files(path, _ZERO3_MODEL_STATES))


def item_prefix(index: int, tied: bool) -> str:
    """The module-key prefix of pipeline item `index` in the non-pipeline module (dsx3d.models.sequential)."""
    return TIED_PREFIX if tied and index == 0 else f"{index}."


def _items_of(module: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in module.items() if k.startswith(prefix)}


def locate(tag_dir: Path, *, pp: int, zero_stage: int, num_items: int, tied: bool, dp: int) -> ItemFiles:
    """The files of a tag written with this layout and ZeRO stage (from the run's recipe)."""
    if pp > 1:
        return ItemFiles(
            "pipeline layer files",
            layer_files(tag_dir),
            lambda path, index: load_bin(path),
            lambda i, t: f"layer_{i:02d}-model_{t:02d}-model_states.pt",
        )
    if zero_stage < 3:
        per_tp = _tp_files(tag_dir, _MODEL_STATES)

        def read_module(path: Path, index: int) -> dict[str, Any]:
            return _items_of(load_bin(path)["module"], item_prefix(index, tied))

        return ItemFiles(
            "model states",
            {i: dict(per_tp) for i in range(num_items)},
            read_module,
            lambda i, t: f"mp_rank_{t:02d}_model_states.pt",
        )
    per_tp = _tp_files(tag_dir, _ZERO3_MODEL_STATES)
    partitions = Zero3Partitions(dp)
    return ItemFiles(
        f"ZeRO-3 partitions over {dp} dp ranks",
        {i: dict(per_tp) for i in range(num_items)},
        lambda path, index: partitions.read(path, item_prefix(index, tied)),
        lambda i, t: f"zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt (and its {dp} optim_states files)",
    )


def _load_optim_states(path: Path) -> dict[str, Any]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


class Zero3Partitions:
    """The fp32 parameters of one TP rank, put together from its dp ranks' ZeRO-3 partitions. The files stay
    memory-mapped: reading an item touches only its parameters' slices."""

    def __init__(self, dp: int):
        self.dp = dp
        self._layouts: dict[
            Path, tuple[list[list[torch.Tensor]], dict[str, tuple[int, int, tuple[int, ...]]]]
        ] = {}

    def _layout(
        self, model_states: Path
    ) -> tuple[list[list[torch.Tensor]], dict[str, tuple[int, int, tuple[int, ...]]]]:
        """Every dp rank's flat fp32 groups, and name -> (group, offset in each rank's flat group, shape)."""
        if model_states not in self._layouts:
            shapes: list[dict[str, Any]] = load_bin(model_states)["param_shapes"]
            optim_name = model_states.name.removeprefix("zero_pp_rank_0_").replace(
                "model_states", "optim_states"
            )
            flats = [
                _load_optim_states(model_states.with_name(f"zero_pp_rank_{d}_{optim_name}"))[
                    "optimizer_state_dict"
                ]["fp32_flat_groups"]
                for d in range(self.dp)
            ]
            index: dict[str, tuple[int, int, tuple[int, ...]]] = {}
            for g, group in enumerate(shapes):
                offset = 0
                for name, shape in group.items():
                    index[name] = (g, offset, tuple(shape))
                    offset += -(-math.prod(shape) // self.dp)  # ceil(numel / dp) per rank, the last padded
                if offset != flats[0][g].numel():
                    raise ValueError(
                        f"{model_states}: parameter group {g} holds {flats[0][g].numel()} elements per rank, "
                        f"its parameters' partitions add up to {offset}: not a ZeRO-3 layout dsx3d knows"
                    )
            self._layouts[model_states] = (flats, index)
        return self._layouts[model_states]

    def read(self, model_states: Path, prefix: str) -> dict[str, torch.Tensor]:
        """The parameters whose names start with `prefix` (the prefix removed), as full fp32 tensors."""
        flats, index = self._layout(model_states)
        out = {}
        for name, (g, offset, shape) in index.items():
            if name.startswith(prefix):
                numel = math.prod(shape)
                part = -(-numel // self.dp)
                pieces = [flats[d][g].narrow(0, offset, part) for d in range(self.dp)]
                out[name[len(prefix) :]] = torch.cat(pieces)[:numel].view(shape)
        return out
