"""TRL's SFTTrainer as a face of dsx3d.Trainer: `class PipelinedSFT(dsx3d.Trainer, trl.SFTTrainer)`.

dsx3d.Trainer comes first, so its data loaders, optimizer, training step and evaluation loop are the ones that
run; SFTTrainer still prepares the dataset (tokenizing, chat templates, completion/assistant masks, packing),
picks the collator (padding-free with packing=True) and logs. dsx3d's step never calls SFTTrainer.compute_loss,
so what that method would add is either computed here or refused:

- the metrics it logs (`mean_token_accuracy`, `entropy`, `num_tokens`) come from the SFT objective
  (`dsx3d.objectives.sft`), which dsx3d.Trainer picks for an SFTTrainer;
- SFTConfig options that change the loss inside compute_loss (`loss_type` other than "nll",
  `activation_offloading`, which wraps SFTTrainer's own training step) are refused by name.
Other TRL trainers (DPO, GRPO, KTO, reward, RLOO, distillation) compute their losses in ways dsx3d's last
stage does not: they are refused.
"""

from __future__ import annotations

from dsx3d.errors import Problem
from dsx3d.objectives import LanguageModeling, Objective, SupervisedFineTuning


def _trl_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"]


def sft_trainer_class(cls: type) -> type | None:
    """TRL's SFTTrainer among `cls`'s bases, or None."""
    return next((c for c in _trl_classes(cls) if c.__name__ == "SFTTrainer"), None)


def refusals(cls: type, args: object) -> list[Problem]:
    """What dsx3d.Trainer cannot honour in a class combining it with a TRL trainer, and in its SFTConfig."""
    trl_bases = _trl_classes(cls)
    if not trl_bases:
        return []
    sft = sft_trainer_class(cls)
    allowed = set(sft.__mro__) if sft is not None else set()
    others = [c.__name__ for c in trl_bases if c not in allowed]
    if others:
        return [
            Problem(
                f"base class {others[0]}",
                f"{others[0]} ({cls.__name__}'s bases)",
                "dsx3d.Trainer supports TRL's SFTTrainer only: other TRL trainers compute their losses (preference pairs, "
                "rewards, generations) in compute_loss, which dsx3d's pipeline step does not run",
                "combine dsx3d.Trainer with trl.SFTTrainer, or train this stage with TRL alone",
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


def objective_for(cls: type) -> Objective:
    """The objective dsx3d.Trainer trains for its class: SFT under an SFTTrainer, else language modelling."""
    return SupervisedFineTuning() if sft_trainer_class(cls) is not None else LanguageModeling()
