"""Where each pipeline item's tensors lie in a DeepSpeed training checkpoint, for each engine's format.

Pipeline items are [embedding, decoder 0 .. L-1, final norm, head] (dsx3d.checkpoint.hf.offline_export). Both engines
name parameters alike ("3.layer.mlp.up_proj.weight", "tied_modules.embed.embed.weight"), but store them
differently:

- pipeline (parallel.pp > 1): one file per item and TP rank, `layer_XX-model_YY-model_states.pt`, keys
  relative to the item; with expert parallelism an item holding experts has one per EP index ZZ instead,
  `layer_XX-model_YY-expert_ZZ-model_states.pt`;
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsx3d.checkpoint.hf.reader import load_bin
from dsx3d.checkpoint.training.disk_format import (
    MODEL_STATES_FILE,
    ZERO3_MODEL_STATES_FILE,
    layer_file_name,
    layer_files,
    model_states_name,
    tp_rank_files,
    zero3_states_name,
)

TIED_PREFIX = "tied_modules.embed."

Reader = Callable[[Path, int], dict[str, Any]]
"""(file, item index) -> that item's tensors, keyed relative to the item ("layer.mlp.up_proj.weight")."""


@dataclass(frozen=True)
class ItemFiles:
    """A tag's files by pipeline item and TP rank, and how to read one item from its file."""

    kind: str
    files: dict[int, dict[tuple[int, int], Path]]
    """item -> (TP rank, EP index) -> file; a file of the non-pipeline formats holds every item of its TP rank
    (EP index 0: expert parallelism needs a pipeline)."""
    read: Reader
    file_name: Callable[[int, int, int | None], str]
    """The file expected for (item, TP rank, EP index or None for an item without split experts): what a
    missing one is called."""


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
            layer_file_name,
        )
    # without a pipeline every item lies in each TP rank's file (EP index 0)
    if zero_stage < 3:
        per_tp = tp_rank_files(tag_dir, MODEL_STATES_FILE)

        def read_module(path: Path, index: int) -> dict[str, Any]:
            return _items_of(load_bin(path)["module"], item_prefix(index, tied))

        return ItemFiles(
            "model states",
            {i: {(t, 0): path for t, path in per_tp.items()} for i in range(num_items)},
            read_module,
            lambda i, t, e: model_states_name(t),
        )
    per_tp = tp_rank_files(tag_dir, ZERO3_MODEL_STATES_FILE)
    partitions = Zero3Partitions(dp)
    return ItemFiles(
        f"ZeRO-3 partitions over {dp} dp ranks",
        {i: {(t, 0): path for t, path in per_tp.items()} for i in range(num_items)},
        lambda path, index: partitions.read(path, item_prefix(index, tied)),
        lambda i, t, e: f"{zero3_states_name(0, t, 'model')} (and its {dp} optim_states files)",
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
            match = ZERO3_MODEL_STATES_FILE.match(model_states.name)
            assert match is not None, model_states
            tp_rank = int(match.group(1))
            flats = [
                _load_optim_states(model_states.with_name(zero3_states_name(d, tp_rank, "optim")))[
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
