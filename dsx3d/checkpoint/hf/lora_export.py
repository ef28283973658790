"""LoRA exports: the adapters in peft's own format, and the base weights with the adapters merged in.

`export_adapter` (a collective) writes a folder `PeftModel.from_pretrained(base_model, folder)` loads:
`adapter_config.json` (peft's LoraConfig, saved by peft) and `adapter_model.safetensors` under peft's saved
names (`base_model.model.<module>.lora_A.weight`: the adapter name dropped, as peft saves it). Adapters are
small, so the TP shards travel to rank 0 as objects and rank 0 writes the folder, staged and published
atomically like every dsx3d export (an existing folder is replaced only if it is an earlier dsx3d export).

`merged_weights` gives, per adapted base weight, this rank's shard of W + s B A: on a column-parallel linear
B_r A is exactly the rows of the merged weight this rank holds, on a row-parallel one B A_r its columns, so
the merge needs no communication and the HF export (`export_hf(..., merge_lora=True)`) writes it as usual.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft.tuners.lora.layer import LoraLayer
from safetensors.torch import save_file
from torch import nn

from dsx3d.boundary_types import HFProcessor
from dsx3d.checkpoint.hf.writer import publish, save_tokenizer, staging_dir
from dsx3d.distributed import comm
from dsx3d.errors import UserError
from dsx3d.models.lora import is_adapter_name
from dsx3d.models.shards import merge_shards

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_saved_name(hf_name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.default.weight` -> peft's saved key
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    module, kind, _adapter, leaf = hf_name.rsplit(".", 3)
    return f"base_model.model.{module}.{kind}.{leaf}"


def merged_weights(module: nn.Module) -> dict[str, Any]:
    """{hf name of an adapted base weight: a function giving this rank's shard of W + sum_a s_a B_a A_a}."""
    out: dict[str, Any] = {}
    for sub in module.modules():
        if not isinstance(sub, LoraLayer):
            continue
        weight: Any = sub.get_base_layer().weight
        name = getattr(weight, "hf_name", None)
        if name is None:
            continue

        def merged(sub: Any = sub, weight: Any = weight) -> torch.Tensor:
            w = weight.detach().float().clone()
            for a in sub.lora_A:
                w += sub.scaling[a] * (sub.lora_B[a].weight.detach().float() @ sub.lora_A[a].weight.detach().float())
            return w

        out[name] = merged
    return out


def adapter_state(engine: Engine3D) -> dict[str, torch.Tensor]:
    """The whole adapter tensors under their hf names, on rank 0 ({} elsewhere). A collective."""
    shards = {}
    if engine.placement.dp == 0:
        shards = {n: s for n, s in engine.hf_shards().items() if is_adapter_name(n)}
    gathered = comm.all_gather_object(shards)
    if comm.get_rank() != 0:
        return {}
    return merge_shards(gathered)  # type: ignore[arg-type]


def export_adapter(engine: Engine3D, out_dir: str | Path, tokenizer: HFProcessor | str | Path | None = None, *, dtype: torch.dtype | None = None) -> Path:
    """Write the trained adapters in peft's format to `out_dir` (module docstring). Every rank calls it."""
    lora = engine.module.dsx3d_builder.lora
    if lora is None:
        raise UserError.single("model.lora", None, "this run trains no LoRA adapters", "export the model with export_hf")
    out = Path(out_dir).absolute()
    state = adapter_state(engine)
    error: str | None = None
    if comm.get_rank() == 0:
        staging = None
        try:
            staging = staging_dir(out)
            config = copy.deepcopy(lora.config)
            config.inference_mode = True
            if not config.base_model_name_or_path:  # where the base came from, when it was a checkpoint
                config.base_model_name_or_path = getattr(engine.hf_config, "_name_or_path", None) or None
            config.save_pretrained(str(staging))
            tensors = {peft_saved_name(n): t.to(dtype or torch.float32).contiguous() for n, t in sorted(state.items())}
            save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            save_tokenizer(staging, tokenizer)
            publish(staging, out)
        except (OSError, UserError, RuntimeError) as err:
            error = f"rank 0: {err}"
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
    error = comm.broadcast_object(error, src=0)  # type: ignore[assignment]
    if error:
        raise RuntimeError(f"adapter export to {out} failed: {error}")
    return out
