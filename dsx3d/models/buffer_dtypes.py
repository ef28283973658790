"""A bf16 or fp16 run's buffers in the dtypes HF gives them in a model loaded in that dtype.

dsx3d builds every model in fp32 and DeepSpeed casts the parameters for a bf16 or fp16 run, keeping buffers as
they are (`_cast_module_mixed_precision`, runtime/engine.py). HF's `from_pretrained(dtype=torch.bfloat16)`
instead builds the model under that default dtype: a buffer computed without an explicit dtype comes out in
bf16 (MiniMax's lightning-attention decays), one computed with `dtype=torch.float` stays fp32 (every rotary
`inv_freq`). A family whose forward multiplies bf16 activations by such a buffer then fails in dsx3d (MiniMax:
"expected m1 and m2 to have the same dtype", found by the generated verify sweep at seed 2077) where HF runs.
`cast_buffers_as_hf` casts each floating buffer to the dtype the same module class's buffer of that name has in
HF's model built on the meta device in the run's dtype (no memory, no weights), except where the class's
keep-in-fp32 lists keep it in fp32 as `from_pretrained` does (`_keep_in_fp32_modules_strict` for bf16 and fp16,
`_keep_in_fp32_modules` for fp16: the routers' `e_score_correction_bias` of DeepSeek-V3-style MoE families)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import PretrainedConfig

from dsx3d.models.family_spec import resolve_family

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(module class's qualified name, buffer name)."""


def run_dtype_of(ds_config: Mapping[str, Any]) -> torch.dtype:
    """The dtype a DeepSpeed config computes in: bf16 or fp16 where it enables one, else fp32."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def hf_buffer_dtypes(config: PretrainedConfig, dtype: torch.dtype) -> dict[Key, torch.dtype]:
    """The floating buffers' dtypes of HF's model of `config` built in `dtype`, by module class and buffer name
    (a key whose modules disagree is left out)."""
    plan = resolve_family(config)
    try:
        with init_empty_weights(include_buffers=True):
            lm = plan.lm_class._from_config(config, dtype=dtype)
    except Exception as exc:  # a family whose __init__ cannot run on the meta device: buffers stay as built
        log.warning("buffers kept in their built dtypes: %s could not be built on the meta device in %s (%s)",
                    plan.lm_class.__name__, dtype, exc)
        return {}
    plan_dtypes = lm._get_dtype_plan(dtype)  # pattern -> dtype, as from_pretrained applies them to loaded names
    kept = [(re.compile(pattern.replace("*", ".*")), kept_dtype) for pattern, kept_dtype in plan_dtypes.items()]
    seen: dict[Key, set[torch.dtype]] = {}
    for prefix, module in lm.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                full = f"{prefix}.{name}" if prefix else name
                target = next((d for pattern, d in kept if pattern.search(full)), buffer.dtype)
                seen.setdefault((type(module).__qualname__, name), set()).add(target)
    return {key: next(iter(dtypes)) for key, dtypes in seen.items() if len(dtypes) == 1}


def cast_buffers_as_hf(module: nn.Module, config: PretrainedConfig, dtype: torch.dtype) -> list[str]:
    """Cast `module`'s floating buffers to the dtypes `hf_buffer_dtypes(config, dtype)` names (nothing for an
    fp32 run); the names of the buffers cast."""
    if dtype not in (torch.bfloat16, torch.float16):
        return []
    wanted = hf_buffer_dtypes(config, dtype)
    cast = []
    for prefix, sub in module.named_modules():
        for name, buffer in list(sub._buffers.items()):
            if buffer is None or not buffer.is_floating_point():
                continue
            target = wanted.get((type(sub).__qualname__, name))
            if target is not None and target != buffer.dtype:
                sub._buffers[name] = buffer.to(target)
                cast.append(f"{prefix}.{name}" if prefix else name)
    return cast
