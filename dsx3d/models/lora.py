"""LoRA through peft on dsx3d's items: injection, TP sharding of the adapters, their initial values, names.

peft injects its own LoRA layers into each owned decoder layer (`inject_adapter_in_model`), with dsx3d's
TP layers registered as custom modules (`dsx3d.distributed.tensor_parallel.lora`), so the adapter weights
are peft's modules under peft's names. Every other parameter is frozen (no gradient, no optimizer state:
only trainable parameters go to DeepSpeed).

Per TP rank (`LoraPath` has the math): on a column-parallel linear B is sharded like the output (dim 0,
marked `tensor_model_parallel`) and A is whole with its gradient summed over TP; on a row-parallel linear A
is sharded like the input (dim 1, marked) and B is whole with its gradient summed over TP. Whole matrices
are not marked, so DeepSpeed's gradient norm counts them once.

Names: an adapter weight's `hf_name` is its name inside the Hugging Face model that peft wraps,
`model.layers.3.self_attn.q_proj.lora_A.default.weight`; exports turn these into peft's files
(`dsx3d.checkpoint.hf.lora_export`).

Initial values are layout-independent: the weight source's tensor when it has one (a resumed or given
adapter, the parity tests), else drawn from a generator seeded by (seed, name) as peft draws them (A
Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zero, or like A when
`init_lora_weights` is false), as a whole tensor that each rank slices.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig
from peft.mapping import inject_adapter_in_model
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.distributed.tensor_parallel.layers import mark_sharded
from dsx3d.distributed.tensor_parallel.lora import CUSTOM_MODULES, ColumnParallelLora, RowParallelLora
from dsx3d.distributed.tensor_parallel.mappings import all_reduce_grad_hook
from dsx3d.models.weights import WeightSource

ADAPTER = "default"
"""peft's adapter name; dsx3d trains one adapter."""


@dataclass(frozen=True)
class LoraSpec:
    """What the builder needs: peft's config and the seed for fresh adapter weights."""

    config: LoraConfig
    seed: int = 0


def hf_param_name(name: str) -> str:
    """A PeftModel's parameter name as dsx3d calls it (the wrapped HF model's name): peft's wrapping
    (`base_model.model.`, `.base_layer`) dropped; plain HF names are unchanged."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def freeze(module: nn.Module) -> None:
    for p in module.parameters():
        p.requires_grad_(False)


def targets(config: LoraConfig, module: nn.Module) -> list[str]:
    """Names of `module`'s submodules peft would adapt (peft's own matching)."""
    return [name for name, _ in module.named_modules() if name and check_target_module_exists(config, name)]


def fresh_adapter_tensor(name: str, shape: tuple[int, ...], config: LoraConfig, seed: int) -> torch.Tensor:
    """The whole (unsharded) initial value of adapter weight `name` (module docstring)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    if ".lora_B." in name and config.init_lora_weights is not False:
        return torch.zeros(shape)
    bound = 1.0 / shape[1] ** 0.5  # fan_in: A (rank, in) -> in; B (out, rank) -> rank
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def inject(module: nn.Module, hf_prefix: str, spec: LoraSpec, tp: TPContext, source: WeightSource) -> None:
    """Add peft LoRA adapters to `module` (an owned item whose parameters are named `hf_prefix + name`) in
    place, shard them over `tp`, hook the gradients of the whole ones and read their values."""
    if not targets(spec.config, module):
        return
    config = copy.deepcopy(spec.config)
    config._register_custom_module(CUSTOM_MODULES)
    inject_adapter_in_model(config, module, adapter_name=ADAPTER)
    for sub_name, sub in module.named_modules():
        if not isinstance(sub, LoraLayer):
            continue
        lora_a: Any = sub.lora_A
        lora_b: Any = sub.lora_B
        for adapter in lora_a:
            a, b = lora_a[adapter].weight, lora_b[adapter].weight
            if tp.size > 1 and isinstance(sub, ColumnParallelLora):
                mark_sharded(b, 0)
                a.register_hook(all_reduce_grad_hook(tp.group))
            elif tp.size > 1 and isinstance(sub, RowParallelLora):
                mark_sharded(a, 1)
                b.register_hook(all_reduce_grad_hook(tp.group))
            for kind, p in (("lora_A", a), ("lora_B", b)):
                _read(p, f"{hf_prefix}{sub_name}.{kind}.{adapter}.weight", spec, tp, source)


def _read(param: nn.Parameter, name: str, spec: LoraSpec, tp: TPContext, source: WeightSource) -> None:
    sharded = getattr(param, "tensor_model_parallel", False)
    shape = list(param.shape)
    if sharded:
        shape[param.partition_dim] *= tp.size  # type: ignore[attr-defined]
    if source.has(name):
        whole = source.load(name)
    else:
        whole = fresh_adapter_tensor(name, tuple(shape), spec.config, spec.seed)
    if tuple(whole.shape) != tuple(shape):
        from dsx3d.errors import UserError

        raise UserError.single("model.lora", name, f"shape {tuple(whole.shape)}, expected {tuple(shape)}", "use an adapter trained for this model and lora.r")
    if sharded:
        dim, n = param.partition_dim, param.shape[param.partition_dim]  # type: ignore[attr-defined]
        whole = whole.narrow(dim, tp.rank * n, n)
    with torch.no_grad():
        param.copy_(whole.to(param.dtype))
    param.hf_name = name  # type: ignore[attr-defined]


def peft_config_from(section: Any) -> LoraConfig:
    """peft's LoraConfig for a recipe's `model.lora` section (checked by dsx3d.checks)."""
    if section.peft_config is not None:
        loaded = LoraConfig.from_pretrained(section.peft_config)
        return loaded
    return LoraConfig(
        r=section.r,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        init_lora_weights=section.init_lora_weights,
        bias="none",
        task_type="CAUSAL_LM",
    )
