"""Recipes nobody here wrote: drawn at random over the whole space a user can write (layouts, ZeRO stages,
precision (fp32, bf16 and fp16, which DeepSpeed refuses on CPU), tied or untied embeddings, attention biases,
vocabularies of published checkpoints against tiny hidden sizes (the head outweighs the layers), head counts tp may not divide, activation checkpointing, explicit
stage splits valid or not, DeepSpeed overrides including HF-style "auto" values, timers, monitors, data
sources that exist or not, chat / instruction / held-out data with missing fields, empty files, too few
examples or no chat template). The checker-soundness property test (tests/distributed/test_checker_soundness.py) asserts
that every one the checker accepts trains, and every one it refuses is refused with the key named."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from dsx3d.recipe.ds_config import deep_merge
from tests.helpers.recipes import TINY_LLAMA

DEGREES = (1, 2, 4)
MAX_WORLD = 8
OVERRIDES: list[dict[str, Any]] = [
    {},
    {"gradient_clipping": "auto"},
    {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
    {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}},
    {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}},
    {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"}},
    {"zero_optimization": {"sub_group_size": "auto"}},
    {"wall_clock_breakdown": True},
    {"csv_monitor": {"enabled": True, "output_path": "{tmp}/csv", "job_name": "grid"}},
    {"comet": {"enabled": True}},
    {"gradient_clipping": 0.5, "steps_per_print": 1},
    {"train_batch_size": 3},
    {"pipeline_parallel": {"stages": 2}},
    {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": True},
]
SOURCES = ["builtin:python-docs", "{tmp}/corpus.jsonl", "{tmp}/missing.txt", "{tmp}/empty_dir", "{tmp}/saved"]
# data sections for chat and instruction data, good and broken: a missing field, an empty file, a tokenizer
# without a chat template, too few examples, held-out data that exists or not
SFT_DATA: list[dict[str, Any]] = [
    {"format": "text", "source": "{tmp}/corpus.jsonl", "eval_fraction": 0.1},
    {"format": "instruction", "source": "{tmp}/qa.jsonl", "prompt_field": "q", "response_field": "a", "eval_fraction": 0.2},
    {"format": "chat", "source": "{tmp}/chat.jsonl", "eval_source": "{tmp}/chat.jsonl"},
    {"format": "chat", "source": "builtin:tiny-chat"},
    {"format": "chat", "source": "{tmp}/chat.jsonl", "eval_fraction": 0.25},
    {"format": "chat", "source": "{tmp}/chat.jsonl", "eval_fraction": 0.02},
    {"format": "chat", "source": "{tmp}/corpus.jsonl"},
    {"format": "chat", "source": "{tmp}/chat.jsonl", "messages_field": "conversation"},
    {"format": "chat", "source": "{tmp}/empty.jsonl"},
    {"format": "chat", "source": "{tmp}/few.jsonl"},
    {"format": "chat", "source": "{tmp}/chat.jsonl", "tokenizer": "{tmp}/tok_without_template"},
    {"format": "chat", "source": "{tmp}/chat.jsonl", "eval_source": "{tmp}/missing.jsonl"},
    {"format": "instruction", "source": "{tmp}/qa.jsonl"},
    {"format": "instruction", "source": "builtin:python-docs"},
    {"format": "text", "source": "{tmp}/empty.jsonl"},
    {"format": "text", "source": "{tmp}/corpus.jsonl", "text_field": "body"},
]


def write_corpus(tmp: Path) -> None:
    """The files SOURCES and SFT_DATA name: small jsonl corpora (text, chat, prompt/response), an empty
    file, an empty directory, a save_to_disk folder and a tokenizer without a chat template."""
    import datasets

    from dsx3d.data.tiny_chat import tiny_chat_conversations
    from dsx3d.data.tokenizer import train_bpe_tokenizer

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "empty_dir").mkdir(exist_ok=True)
    (tmp / "empty.jsonl").write_text("")
    docs = [f"document {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(200)]
    _jsonl(tmp / "corpus.jsonl", [{"text": d} for d in docs])
    chats = tiny_chat_conversations(80)
    _jsonl(tmp / "chat.jsonl", [{"messages": c} for c in chats])
    _jsonl(tmp / "few.jsonl", [{"messages": c} for c in chats[:2]])
    _jsonl(tmp / "qa.jsonl", [{"q": f"What is {i} plus 2?", "a": f"{i + 2}."} for i in range(80)])
    if not (tmp / "saved").is_dir():
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp / "saved"))
    train_bpe_tokenizer(docs, 256).save_pretrained(str(tmp / "tok_without_template"))


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fill(value: Any, tmp: Path) -> Any:
    if isinstance(value, dict):
        return {k: _fill(v, tmp) for k, v in value.items()}
    return value.replace("{tmp}", str(tmp)) if isinstance(value, str) else value


def random_recipe(rng: random.Random, tmp: Path) -> dict[str, Any]:
    """One recipe dict (it may be invalid on purpose), training 1 step on tiny shapes."""
    while True:
        dp, tp, pp = (rng.choice(DEGREES) for _ in range(3))
        if dp * tp * pp <= MAX_WORLD:
            break
    heads = rng.choice([4, 6])
    layers = rng.choice([2, 4])
    model = {
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([k for k in (1, 2, 3, heads) if heads % k == 0]),
        "hidden_size": heads * 8,
        "intermediate_size": rng.choice([48, 64, 72]),
        "num_hidden_layers": layers,
        "vocab_size": rng.choice([256, 301, 32000, 151936]),
        "tie_word_embeddings": rng.random() < 0.5,
        "attention_bias": rng.random() < 0.5,
    }
    parallel: dict[str, Any] = {"dp": rng.choice([dp, "auto"]), "tp": tp, "pp": pp}
    if pp > 1 and rng.random() < 0.3:
        first = rng.randint(0, layers)
        parallel["stage_layers"] = [first, layers - first] + [1] * (pp - 2)  # sometimes valid (pp 2), often not
    recipe: dict[str, Any] = {
        "model": {"config": model},
        "parallel": parallel,
        "cluster": {"nodes": 1, "gpus_per_node": dp * tp * pp},
        "train": {
            "steps": 1,
            "micro_batch_size": rng.choice([1, 2]),
            "gradient_accumulation_steps": rng.choice([1, 2, 4]),
            "seq_len": rng.choice([16, 32]),
            "dtype": rng.choice(["fp32", "bf16", "bf16", "fp16"]),
            "activation_checkpointing": rng.random() < 0.3,
        },
        "zero": {"stage": rng.choice([0, 1, 2, 3])},
        "data": {"source": rng.choice(SOURCES), "tokenizer_vocab_size": 256, "cache_dir": str(tmp / "cache")},
        "deepspeed": rng.choice(OVERRIDES),
        "output_dir": str(tmp / "run"),
    }
    if rng.random() < 0.4:  # chat / instruction / held-out data, good or broken
        recipe["data"].update(rng.choice(SFT_DATA))
        recipe["train"]["seq_len"] = 64  # shorter rows cut most answers, which only tokenizing shows
        recipe["train"]["eval_interval"] = rng.choice([0, 1])
    return _fill(deep_merge(TINY_LLAMA, recipe), tmp)
