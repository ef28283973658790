"""TRL's SFTTrainer as a face of dsx3d.Trainer: `class PipelinedSFT(dsx3d.Trainer, trl.SFTTrainer)`.

dsx3d.Trainer comes first, so its data loaders, optimizer, training step and evaluation loop are the ones that
run; SFTTrainer still prepares the dataset (tokenizing, chat templates, completion/assistant masks, packing),
picks the collator (padding-free with packing=True) and logs. dsx3d's step never calls SFTTrainer.compute_loss,
so what that method would add is either computed here or refused:

- the metrics it logs (`mean_token_accuracy`, `entropy`, `num_tokens`) come from the SFT objective
  (`dsx3d.objectives.sft`), which dsx3d.Trainer picks for an SFTTrainer;
- SFTConfig options that change the loss inside compute_loss (`loss_type` other than "nll",
  `activation_offloading`, which wraps SFTTrainer's own training step) are refused by name.
TRL's DPOTrainer trains DPO (`dsx3d.integrations.trl_dpo`). Other TRL trainers (GRPO, KTO, reward, RLOO,
distillation) compute their losses in ways dsx3d's last stage does not: they are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from dsx3d.errors import Problem
from dsx3d.integrations.patches import no_trl_reference
from dsx3d.integrations.trl_dpo import dpo_objective, dpo_refusals, drop_trl_ref_adapter, reference_mode  # noqa: F401
from dsx3d.objectives import LanguageModeling, Objective, SupervisedFineTuning


def _trl_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"]


def sft_trainer_class(cls: type) -> type | None:
    """TRL's SFTTrainer among `cls`'s bases, or None."""
    return next((c for c in _trl_classes(cls) if c.__name__ == "SFTTrainer"), None)


def dpo_trainer_class(cls: type) -> type | None:
    """TRL's DPOTrainer among `cls`'s bases, or None."""
    return next((c for c in _trl_classes(cls) if c.__name__ == "DPOTrainer"), None)


def init_context(cls: type) -> contextlib.AbstractContextManager[None]:
    """Around the TRL trainer's __init__: DPOTrainer loads no reference model of its own (dsx3d's is on the pipeline)."""
    return no_trl_reference() if dpo_trainer_class(cls) is not None else contextlib.nullcontext()


def reference_for(trainer: Any, engine: Any, loss: Any) -> Any:
    """The reference pass of the trainer's objective (dsx3d.engine.reference), or None when it needs none."""
    if loss.objective.reference is None:
        return None
    from dsx3d.engine.reference import Reference

    return Reference(engine, loss, reference_mode(trainer))


def hf_kwargs(cls: type, compute_loss_func: Callable[..., Any] | None, preprocess: Callable[..., Any] | None) -> dict[str, Any]:
    """The arguments of HF's Trainer that the next class's __init__ takes (DPOTrainer takes neither)."""
    if dpo_trainer_class(cls) is not None:
        return {}
    return {"compute_loss_func": compute_loss_func, "preprocess_logits_for_metrics": preprocess}


def refusals(cls: type, args: object, trl_kwargs: dict[str, Any] | None = None) -> list[Problem]:
    """What dsx3d.Trainer cannot honour in a class combining it with a TRL trainer, and in its SFTConfig or
    DPOConfig; `trl_kwargs`: the arguments given for the TRL trainer only (ref_model, peft_config)."""
    trl_kwargs = trl_kwargs or {}
    trl_bases = _trl_classes(cls)
    if not trl_bases:
        return [Problem("Trainer arguments", sorted(trl_kwargs), "not arguments of transformers.Trainer", "drop them")] if trl_kwargs else []
    dpo = dpo_trainer_class(cls)
    if dpo is not None and not [c for c in trl_bases if c not in set(dpo.__mro__)]:
        return dpo_refusals(args, trl_kwargs)
    sft = sft_trainer_class(cls)
    allowed = set(sft.__mro__) if sft is not None else set()
    others = [c.__name__ for c in trl_bases if c not in allowed]
    if others:
        return [
            Problem(
                f"base class {others[0]}",
                f"{others[0]} ({cls.__name__}'s bases)",
                "dsx3d.Trainer supports TRL's SFTTrainer and DPOTrainer: other TRL trainers compute their losses "
                "(rewards, generations) in compute_loss, which dsx3d's pipeline step does not run",
                "combine dsx3d.Trainer with trl.SFTTrainer or trl.DPOTrainer, or train this stage with TRL alone",
            )
        ]
    problems = []
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type != "nll":
        problems.append(
            Problem(
                "SFTConfig.loss_type",
                loss_type,
                "dsx3d's last stage computes the token-mean cross-entropy (nll) on vocabulary shards; "
                "SFTTrainer.compute_loss, where the other loss types live, is not run",
                'set loss_type="nll" (dsx3d never materialises the full logits, so chunking buys nothing)',
            )
        )
    if getattr(args, "activation_offloading", False):
        problems.append(
            Problem(
                "SFTConfig.activation_offloading",
                True,
                "it wraps SFTTrainer's training step, which dsx3d's replaces",
                "set it to False (train.activation_checkpointing in the recipe saves activation memory)",
            )
        )
    return problems


def objective_for(cls: type, args: object = None) -> Objective:
    """The objective dsx3d.Trainer trains for its class: SFT under an SFTTrainer, DPO (from its DPOConfig) under a
    DPOTrainer, else language modelling."""
    if dpo_trainer_class(cls) is not None:
        return dpo_objective(args)
    return SupervisedFineTuning() if sft_trainer_class(cls) is not None else LanguageModeling()
