"""TRL's DPOTrainer as a face of dsx3d.Trainer (`class PipelinedDPO(dsx3d.Trainer, trl.DPOTrainer)`): the DPO objective
from its DPOConfig, the reference mode from its model and config, and the DPOConfig options refused by name.

DPOTrainer still prepares the dataset (chat templates, tokenizing prompt / chosen / rejected), picks the
preference collator and logs; dsx3d's step never calls DPOTrainer.compute_loss: the last stage computes the loss
and TRL's metrics (`dsx3d.objectives.dpo`) and the reference's log-probs come from a forward-only pass on the same
pipeline (`dsx3d.engine.reference`), never from DPOTrainer's own `ref_model`.
"""

from __future__ import annotations

from typing import Any

from dsx3d.errors import Problem
from dsx3d.integrations.peft_model import is_peft_model
from dsx3d.objectives.dpo import DirectPreference
from dsx3d.objectives.dpo_math import DPOLossConfig

# DPOConfig options whose effect lives in code dsx3d does not run: (attribute, value allowed, why, fix)
_REFUSED: list[tuple[str, Any, str, str]] = [
    ("ld_alpha", None, "it weighs each pair's shared and tail tokens differently (LD-DPO)", "set ld_alpha=None"),
    ("use_weighting", False, "WPO's weights need every token's probability mass", "set use_weighting=False"),
    ("sync_ref_model", False, "dsx3d's reference is fixed (the initial weights or the base model)", "set sync_ref_model=False"),
    ("padding_free", False, "DPO micro-batches are padded pairs", "set padding_free=False"),
    ("activation_offloading", False, "it wraps DPOTrainer's training step, which dsx3d's replaces",
     "set it to False (train.activation_checkpointing in the recipe saves activation memory)"),
    ("precompute_ref_log_probs", False, "DPOTrainer would run its precompute pass with the whole model on every rank, "
     "in a DeepSpeed engine of its own", "precompute once elsewhere and keep the ref_chosen_logps / ref_rejected_logps "
     "columns in the dataset (dsx3d then skips its reference pass), or leave it False"),
    ("use_liger_kernel", False, "its kernels replace the model's forward, which dsx3d's stages run instead", "set use_liger_kernel=False"),
]  # fmt: skip


def dpo_refusals(args: object, trl_kwargs: dict[str, Any]) -> list[Problem]:
    """What dsx3d.Trainer cannot honour of a DPOConfig and of DPOTrainer's own arguments."""
    problems = []
    for key, value, why in DPOLossConfig.from_args(args).unsupported():
        problems.append(Problem(f"DPOConfig.{key}", value, f"dsx3d computes DPO's per-pair losses on the last stage; {why}",
                                "use a per-pair loss type (sigmoid, hinge, ipo, robust, exo_pair, ...)"))  # fmt: skip
    for key, allowed, why, fix in _REFUSED:
        value = getattr(args, key, allowed)
        if value != allowed:
            problems.append(Problem(f"DPOConfig.{key}", value, why, fix))
    if trl_kwargs.get("ref_model") is not None:
        problems.append(
            Problem(
                "DPOTrainer(ref_model=...)", type(trl_kwargs["ref_model"]).__name__,
                "dsx3d's reference is the policy's initial weights on the same pipeline (a frozen copy), the base "
                "model of a LoRA policy, or precomputed log-probs; another model's weights are not loaded",
                "omit ref_model (the model's initial weights are the reference), or put its log-probs in the dataset's "
                "ref_chosen_logps / ref_rejected_logps columns",
            )
        )  # fmt: skip
    if trl_kwargs.get("peft_config") is not None:
        problems.append(
            Problem(
                "DPOTrainer(peft_config=...)", type(trl_kwargs["peft_config"]).__name__,
                "dsx3d reads the adapters from the model it is given, before DPOTrainer would wrap it",
                "pass model=peft.get_peft_model(model, peft_config) instead",
            )
        )  # fmt: skip
    unknown = sorted(k for k in trl_kwargs if k not in ("ref_model", "peft_config"))
    if unknown:
        problems.append(Problem("Trainer arguments", unknown, "not arguments of dsx3d.Trainer or DPOTrainer", "drop them"))
    return problems


def dpo_objective(args: object) -> DirectPreference:
    return DirectPreference(DPOLossConfig.from_args(args))


def reference_mode(trainer: Any) -> str:
    """adapters_off (a LoRA policy whose adapters are fresh: every lora_B
    zero, so the base model is its initial self); else copy (the initial trainable weights: TRL's "ref" adapter
    of a trained adapter, or the whole model)."""
    model = trainer.model
    if is_peft_model(model):
        fresh = all(not bool(p.detach().any()) for n, p in model.named_parameters() if ".lora_B." in n)
        return "adapters_off" if fresh else "copy"
    return "copy"


def drop_trl_ref_adapter(model: Any) -> None:
    """DPOTrainer adds a "ref" copy of a PeftModel's adapter for its own reference pass; dsx3d's reference pass
    replaces it (`reference_mode`), and the engine trains and exports the one adapter it read."""
    if is_peft_model(model) and "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
