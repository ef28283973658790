"""Which optimizer wrapper DeepSpeed's engine builds for a config, without DeepSpeed.

This mirrors `DeepSpeedEngine._do_optimizer_sanity_check` (runtime/engine.py) decision by decision; the
estimator needs it because only one of the wrappers, BF16_Optimizer with fp32 accumulation, keeps an
unsharded fp32 gradient buffer (4 bytes per parameter on every rank). The names are DeepSpeed's constants
(runtime/constants.py and engine.py); tests compare this function with the engine's own method.
"""

from __future__ import annotations

BF16_OPTIMIZER = "bf16"  # BF16_Optimizer
ZERO_OPTIMIZER = "zero_optimization"  # DeepSpeedZeroOptimizer (stage 1/2) or stage 3
FP16_OPTIMIZER = "fp16"  # FP16_Optimizer / FP16_UnfusedOptimizer
DDP_BF16_OPTIMIZER = "ddp_bf16"  # the fp16 wrapper driving bf16
BASIC = None  # the torch optimizer itself


def grad_accum_dtype(dtype: str, zero_stage: int) -> str | None:
    """`data_types.grad_accum_dtype` as dsx3d's generated config writes it: fp32 for bf16 under ZeRO
    (DeepSpeed refuses the mix without ZeRO), otherwise unset (DeepSpeed then accumulates in the model dtype)."""
    return "fp32" if dtype == "bf16" and zero_stage >= 1 else None


def optimizer_wrapper(
    dtype: str, zero_stage: int, accum_dtype: str | None, *, pipeline: bool, cpu_offload: bool = False
) -> str | None:
    """The wrapper DeepSpeed picks for model `dtype` ("fp32", "fp16", "bf16") and `accum_dtype` (None: the
    model dtype). Raises ValueError for the mix DeepSpeed refuses (different dtypes without ZeRO)."""
    accum = dtype if accum_dtype is None else accum_dtype
    if zero_stage > 0:
        if dtype == "bf16" and accum == "fp32" and zero_stage == 1 and not cpu_offload:
            return BF16_OPTIMIZER
        return ZERO_OPTIMIZER
    if dtype != accum:
        raise ValueError(f"DeepSpeed refuses model dtype {dtype} with gradient accumulation in {accum} without ZeRO")
    if dtype == "fp32":
        return BASIC
    if dtype == "bf16" and pipeline:
        return BF16_OPTIMIZER
    return FP16_OPTIMIZER if dtype == "fp16" else DDP_BF16_OPTIMIZER


def keeps_fp32_grad_buffer(
    dtype: str, zero_stage: int, accum_dtype: str | None, *, pipeline: bool, cpu_offload: bool = False
) -> bool:
    """Whether the picked optimizer holds the unsharded fp32 gradient buffer (BF16_Optimizer accumulating
    in fp32)."""
    try:
        wrapper = optimizer_wrapper(dtype, zero_stage, accum_dtype, pipeline=pipeline, cpu_offload=cpu_offload)
    except ValueError:
        return False
    return wrapper == BF16_OPTIMIZER and (accum_dtype or dtype) == "fp32"
