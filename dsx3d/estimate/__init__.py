"""Pure estimates of per-device memory and step time for a dp x tp x pp layout (no processes, no tensors).

    shape = shape_from_hf_config(config)          # or shape_from_params(7.5e9)
    est = estimate(shape, Setup(dp=8, tp=2, pp=4, zero_stage=1, micro_batch_size=1, seq_len=4096,
                                grad_accum=32, activation_checkpointing=True),
                   Hardware(gpu_memory_gb=80))
    est.stages[0].total_gb, est.step_time_s, est.mfu

Model states follow the ZeRO paper (Rajbhandari et al. 2020), activations Korthikanti et al. 2022, FLOPs
and the pipeline bubble Narayanan et al. 2021; see `memory.py` and `timing.py` for the formulas.
"""

from dsx3d.estimate.estimator import GB, Estimate, Hardware, Setup, StageEstimate, estimate
from dsx3d.estimate.memory import (
    StateBytes,
    layer_activation_bytes,
    model_state_bytes,
    split_layers,
    stage_activation_bytes,
    stage_params,
)
from dsx3d.models.shape import ModelShape, ParamCount, shape_from_hf_config, shape_from_params
from dsx3d.plan.layout import bubble_fraction

__all__ = [
    "GB",
    "Estimate",
    "Hardware",
    "ModelShape",
    "ParamCount",
    "Setup",
    "StageEstimate",
    "StateBytes",
    "bubble_fraction",
    "estimate",
    "layer_activation_bytes",
    "model_state_bytes",
    "shape_from_hf_config",
    "shape_from_params",
    "split_layers",
    "stage_activation_bytes",
    "stage_params",
]
