"""peft LoRA layers on dsx3d's column- and row-parallel linears (the math: `context.LoraPath`).

They subclass peft's own `lora.Linear`, so peft creates, names (`lora_A.<adapter>.weight`), scales and
switches the adapters; only the forward differs: the adapter runs on this rank's shard through the TP
region boundaries. peft sizes lora_A/lora_B from the base layer's *local* features, which gives exactly
the shards wanted: column-parallel A (rank, in) whole and B (out/t, rank); row-parallel A (rank, in/t) and
B (out, rank) whole. `dsx3d.models.lora` registers them with peft (`LoraConfig._register_custom_module`),
marks the sharded matrix and hooks the replicated one's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from dsx3d.distributed.tensor_parallel.context import LoraPath
from dsx3d.distributed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dsx3d.distributed.tensor_parallel.mappings import split_last_dim


class _TPLora(PeftLoraLinear):
    def _get_in_out_features(self, module: Any) -> tuple[int, int]:
        return int(module.in_features), int(module.out_features)  # this rank's shard

    def lora_paths(self) -> list[LoraPath]:
        if self.disable_adapters or self.merged:
            return []
        lora_a: Any = self.lora_A
        lora_b: Any = self.lora_B
        return [
            LoraPath(lora_a[a].weight, lora_b[a].weight, self.scaling[a], self.lora_dropout[a])
            for a in self.active_adapters
            if a in self.lora_A
        ]

    def merge(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("dsx3d merges LoRA into the exported model (model.lora.merge_on_export), not in place")


class ColumnParallelLora(_TPLora):
    """LoRA on a `ColumnParallelLinear`: B's rows shard like the output, A is whole."""

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        base: Any = self.get_base_layer()  # a ColumnParallelLinear
        return base.tp.column_linear(
            x, base.weight, base.bias, training=base.training, gather_output=base.gather_output, lora=self.lora_paths()
        )


class RowParallelLora(_TPLora):
    """LoRA on a `RowParallelLinear`: A's columns shard like the input, B is whole."""

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        base: Any = self.get_base_layer()  # a RowParallelLinear
        tp = base.tp
        if tp.on_shards:
            raise RuntimeError(
                "sequence parallelism: a row-parallel linear ran outside its parent module's forward; "
                "set parallel.sequence_parallel: false for this model"
            )
        if base.split_input:
            x = split_last_dim(x, tp.group)
        part = F.linear(x, base.weight)  # (b, s, in/t) @ (in/t, out): partial over TP
        for path in self.lora_paths():
            part = part + path.row_term(x)
        y = tp.exit_region(part, training=base.training)
        return y if base.bias is None else y + base.bias


CUSTOM_MODULES: dict[type[nn.Module], type[nn.Module]] = {
    ColumnParallelLinear: ColumnParallelLora,
    RowParallelLinear: RowParallelLora,
}
"""peft's custom-module mapping (base layer type -> LoRA layer type)."""
