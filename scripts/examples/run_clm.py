"""A run_clm-style fine-tuning script (transformers' examples/pytorch/language-modeling/run_clm.py, cut down to
what runs here without a download), switched to dsx3d by two lines, both marked `# dsx3d`:

    from dsx3d import Trainer               # was: from transformers import Trainer
    --deepspeed my-recipe.yaml              # was: --deepspeed ds_config.json (or nothing)

Everything else is HF's: HfArgumentParser over TrainingArguments, tokenize, group_texts into blocks,
default_data_collator, compute_metrics on argmax predictions (run_clm's own preprocess_logits_for_metrics),
train(), save_model(), evaluate() and perplexity. The layout fixes the micro-batch, accumulation, clipping and
precision; TrainingArguments that leave them at HF's defaults take them over.

    python scripts/examples/run_clm.py --make_tiny runs/tiny-llama            # a local checkpoint to start from
    python scripts/examples/run_clm.py --model_name_or_path runs/tiny-llama --deepspeed recipe.yaml \\
        --output_dir runs/clm --max_steps 20 --do_train --do_eval --logging_steps 1 --report_to none
    accelerate launch --config_file accelerate.yaml scripts/examples/run_clm.py --model_name_or_path ... \\
        --output_dir ...        # the layout from accelerate's DeepSpeed config (`dsx3d accelerate-config`)

The text is Python's own documentation (`pydoc_data`), so nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    TrainingArguments,
    default_data_collator,
)

from dsx3d import Trainer  # dsx3d: was `from transformers import Trainer`; before TrainingArguments are built


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local HF checkpoint directory"})


@dataclass
class DataArguments:
    block_size: int = field(default=32, metadata={"help": "tokens per training sample (<= the layout's seq_len)"})
    max_train_samples: int = field(default=256)
    max_eval_samples: int = field(default=16)
    log_json: str | None = field(default=None, metadata={"help": "write the log history here (rank 0)"})


def make_tiny_checkpoint(path: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """A 4-layer Llama and a byte-level BPE tokenizer trained on Python's docs, saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsx3d.data import python_docs_documents, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(python_docs_documents(), vocab_size)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def lm_datasets(tokenizer: Any, data_args: DataArguments) -> tuple[Any, Any]:
    """run_clm's preprocessing: tokenize the texts, concatenate them, cut blocks of block_size; labels = inputs."""
    import datasets

    from dsx3d.data import python_docs_documents

    raw = datasets.Dataset.from_dict({"text": python_docs_documents()})
    tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])
    size = data_args.block_size

    def group_texts(examples: dict[str, list[Any]]) -> dict[str, list[Any]]:
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // size * size
        result = {k: [t[i : i + size] for i in range(0, total, size)] for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    blocks = tokenized.map(group_texts, batched=True)
    n_train, n_eval = data_args.max_train_samples, data_args.max_eval_samples
    return blocks.select(range(n_train)), blocks.select(range(n_train, n_train + n_eval))


def preprocess_logits_for_metrics(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)  # run_clm's own; `dsx3d.argmax_logits` does the same without gathering the vocab


def compute_metrics(eval_preds: Any) -> dict[str, float]:
    preds, labels = eval_preds
    labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
    scored = labels != -100
    return {"accuracy": float((preds[scored] == labels[scored]).mean())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv and argv[0] == "--make_tiny":
        print(make_tiny_checkpoint(Path(argv[1])))
        return {}
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    train_set, eval_set = lm_datasets(tokenizer, data_args)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_set if training_args.do_train else None,
        eval_dataset=eval_set if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )
    metrics: dict[str, Any] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics.update(result.metrics)
    if training_args.do_eval:
        evaluated = trainer.evaluate()
        evaluated["perplexity"] = math.exp(evaluated["eval_loss"])
        metrics.update(evaluated)
        trainer.log_metrics("eval", evaluated)
    if trainer.is_world_process_zero() and data_args.log_json:
        Path(data_args.log_json).write_text(json.dumps({"log_history": trainer.state.log_history, "metrics": metrics}))
    return {"log_history": trainer.state.log_history, "metrics": metrics}


if __name__ == "__main__":
    main(sys.argv[1:])
