"""dsx3d.Trainer with a peft model: `get_peft_model(hf_model, LoraConfig(...))` trains its LoRA adapters.

The PeftModel's LoraConfig becomes the recipe's `model.lora` (the engine then injects the same adapters
through peft, frozen base), its tensors are the weights (peft names mapped back to the HF model's,
`dsx3d.models.lora.hf_param_name`), and save_model() writes the adapters in peft's format, as HF's Trainer
does for a PeftModel. Anything else with frozen parameters is refused by the Trainer.
"""

from __future__ import annotations

from typing import Any

from dsx3d.checks.lora import config_problems
from dsx3d.errors import Problem
from dsx3d.recipe.schema import LoraSection, Recipe


def is_peft_model(model: object) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def lora_from_peft_model(model: Any, recipe: Recipe) -> list[Problem]:
    """Set `recipe.model.lora` from a PeftModel's LoRA adapter (nothing for other models); the problems
    that keep dsx3d from training it."""
    if not is_peft_model(model):
        return []
    from peft import LoraConfig

    configs = dict(model.peft_config)
    key = "Trainer(model=PeftModel)"
    if len(configs) != 1 or not isinstance(next(iter(configs.values())), LoraConfig):
        kinds = sorted(f"{name}: {type(c).__name__}" for name, c in configs.items())
        return [Problem(key, kinds, "dsx3d.Trainer trains one LoRA adapter", "wrap the model with one LoraConfig")]
    name, config = next(iter(configs.items()))
    problems = list(config_problems(config, f"{key}.peft_config"))
    if name != "default":
        problems.append(Problem(f"{key}.adapter_name", name, "dsx3d trains peft's default adapter", "use get_peft_model(model, config) without adapter_name"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    if trainable:
        problems.append(
            Problem(f"{key}.parameters", trainable[:5], "trainable parameters besides the LoRA adapters", "freeze them (peft does unless modules_to_save asks otherwise)")
        )
    if problems:
        return problems
    recipe.model.lora = LoraSection(
        r=int(config.r),
        alpha=float(config.lora_alpha),
        dropout=float(config.lora_dropout),
        target_modules=sorted(config.target_modules),
        init_lora_weights=bool(config.init_lora_weights),
    )
    return []
