"""TrainingArguments.optim under dsx3d.Trainer: which of transformers' OptimizerNames train the same run, which are refused and why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsx3d.boundary_types import HFTrainingArguments, ParamGroup

ENGINE_ADAMW = ("adamw_torch", "adamw_torch_fused")
"""DeepSpeed's own AdamW section (torch_adam), HF's torch AdamW (fused changes kernels, not the update)."""
ELEMENTWISE = ("sgd", "rmsprop")
"""torch optimizers whose update of an element reads only that element's state: DeepSpeed drives them as client
optimizers over a stage's TP shards and ZeRO's flat partitions with the same update as over whole tensors."""

# why each other name is not the same run, by the start of its value (checked after a missing package)
_WHY = {
    "adamw_torch_xla": "it needs an XLA device (torch_xla)",
    "adamw_torch_npu_fused": "it needs an Ascend NPU (torch_npu)",
    "adagrad": "torch's Adagrad builds its state for every parameter at construction, before ZeRO swaps the "
    "parameters for its flat partitions: DeepSpeed 0.19.8 then fails in its first gradient reduction",
    "adafactor": "Adafactor factors each weight's second moment by rows and columns and clips by the update's RMS "
    "over the whole tensor; dsx3d's TP shards and ZeRO's flat partitions are not whole tensors",
    "galore": "GaLore projects whole 2-D weights onto a low rank; TP shards and ZeRO partitions are not whole weights",
    "apollo": "APOLLO projects whole 2-D weights; TP shards and ZeRO partitions are not whole weights",
    "lomo": "LOMO fuses the update into the backward pass of the HF model, which the pipeline does not run",
    "adalomo": "AdaLomo fuses the update into the backward pass of the HF model, which the pipeline does not run",
    "schedule_free": "schedule-free optimizers swap the weights between train and eval points, which the engine does not",
}
_QUANTIZED = "its states are quantized tensor subclasses that ZeRO's flat fp32 partitions cannot hold"


def optim_name(args: HFTrainingArguments) -> str:
    return str(getattr(args.optim, "value", args.optim))


def supported() -> list[str]:
    return [*ENGINE_ADAMW, *ELEMENTWISE]


def refusal_reason(args: HFTrainingArguments) -> str | None:
    """None when `optim` trains the same run; otherwise why not (a missing package named first)."""
    name = optim_name(args)
    if name in ENGINE_ADAMW or name in ELEMENTWISE:
        return None
    from transformers import Trainer

    try:
        Trainer.get_optimizer_cls_and_kwargs(args, None)  # HF's own check of the optimizer's package
    except (ImportError, ValueError) as err:  # HF raises either for a package it cannot import
        text = " ".join(str(err).split())
        if "install" in text.lower() or "import" in text.lower():
            return f"it needs a package that is not installed ({text})"
    except Exception:  # noqa: BLE001 (an optimizer HF builds only with the model: refused below by name)
        pass
    for start, why in _WHY.items():
        if name.startswith(start):
            return why
    if any(k in name for k in ("8bit", "4bit", "bnb", "paged", "32bit", "ademamix", "lion")):
        return _QUANTIZED if "torch_" in name else "bitsandbytes' optimizers keep per-tensor (block) states and CUDA kernels"
    return "dsx3d has not checked it against transformers"


def engine_optimizer(args: HFTrainingArguments) -> tuple[dict[str, Any] | None, Callable[[list[ParamGroup]], torch.optim.Optimizer] | None]:
    """(the DeepSpeed "optimizer" section, or None for none; a client-optimizer factory over the param groups,
    or None). AdamW stays DeepSpeed's own section (torch AdamW); the elementwise ones are HF's class and
    keyword arguments exactly (Trainer.get_optimizer_cls_and_kwargs), built over the stage's groups."""
    name = optim_name(args)
    if name in ELEMENTWISE:
        from transformers import Trainer

        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, None)
        return None, lambda groups: cls(groups, **kwargs)
    section = {
        "type": "AdamW",
        "params": {"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
                   "weight_decay": args.weight_decay, "torch_adam": True, "adam_w_mode": True},
    }  # fmt: skip
    return section, None


def zero_overrides(client_optimizer: object) -> dict[str, Any]:
    """ZeRO refuses a client optimizer it has not tested unless told: the elementwise ones are safe on its flat
    partitions (each element's update reads only its own state)."""
    return {"zero_allow_untested_optimizer": True} if client_optimizer is not None else {}
