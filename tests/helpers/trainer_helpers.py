"""What the Trainer tests share: a tiny Llama, token datasets, a `dsx3d config` JSON for a layout, and
TrainingArguments that equal the layout's values. fp32 throughout, so 3D runs match plain HF to round-off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dsx3d.models.known_families import tiny_config
from dsx3d.recipe.ds_config import build_ds_config
from dsx3d.recipe.schema import recipe_from_dict

SEQ = 16
MICRO = 2  # micro-batch size
ACCUM = 2  # micro-batches per optimizer step and DP rank
VOCAB = 128


def tiny_llama() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config("llama", tie_word_embeddings=False))


def train_set(samples: int = 48) -> Any:
    """Fixed token ids; some labels ignored (-100), so micro-batches score different numbers of tokens and the
    loss must be weighted by tokens over the whole step, as HF's Trainer does."""
    import datasets

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.3] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def eval_set(samples: int = 10) -> Any:
    import datasets

    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(2))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def layout_recipe(dp: int, tp: int, pp: int, zero_stage: int = 1, cp: int = 1, **train: Any) -> dict[str, Any]:
    return {
        "model": {"config": {"model_type": "llama"}},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": cp},
        "cluster": {"nodes": 1, "gpus_per_node": dp * cp * tp * pp},
        "train": {
            "micro_batch_size": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "seq_len": SEQ,
            "dtype": "fp32",
            "grad_clip": 1.0,
            **train,
        },
        "zero": {"stage": zero_stage},
    }


def write_ds_config(path: Path, dp: int, tp: int, pp: int, zero_stage: int = 1, cp: int = 1, **train: Any) -> Path:
    """The JSON `dsx3d config` writes for this layout."""
    recipe = recipe_from_dict(layout_recipe(dp, tp, pp, zero_stage, cp, **train))
    path.write_text(json.dumps(build_ds_config(recipe, dp * cp * tp * pp)))
    return path


def training_args(out: Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=4,
        learning_rate=2e-3,
        weight_decay=0.1,  # HF exempts biases and norms: the 3D optimizer must group the same way
        warmup_steps=1,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        per_device_eval_batch_size=MICRO,
        include_num_input_tokens_seen="all",
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def step_values(history: list[dict[str, Any]], key: str) -> list[float]:
    """The per-step values of `key` in a Trainer's log history (not the end-of-training summary)."""
    return [h[key] for h in history if key in h and "train_loss" not in h]


HF_AUTO_CONFIG = {  # the shape of the ZeRO configs in HF's examples and docs
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto", "allgather_partitions": True, "overlap_comm": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
