"""Fine-tune a local Hugging Face checkpoint with `dsx3d.Trainer`, the drop-in for `transformers.Trainer`.

One process (a layout of 1 x 1 x 1), or the layout's processes under any torchrun-style launcher:

    dsx3d config RECIPE.yaml -o ds.json --world-size 1
    python scripts/examples/trainer.py --ds-config ds.json [--model DIR]

    dsx3d accelerate-config RECIPE.yaml -o accelerate.yaml
    accelerate launch --config_file accelerate.yaml scripts/examples/trainer.py [--model DIR]

Without --model it first creates a tiny Llama checkpoint (save_pretrained), with a byte-level BPE tokenizer
trained on Python's own documentation, in OUTPUT_DIR/tiny-llama. The data is that documentation, tokenized and
cut into blocks of the layout's seq_len. Batch size, accumulation, clipping and precision are read from the
layout, so TrainingArguments agree with it (dsx3d.Trainer refuses any disagreement).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from dsx3d import Trainer  # first: it lets TrainingArguments accept a recipe path and use dsx3d's layout

ACCELERATE_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
DONE = ".complete"


def make_tiny_checkpoint(path: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """A 4-layer Llama and its tokenizer, saved with save_pretrained. Deterministic: same files every time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsx3d.data import python_docs_documents, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(python_docs_documents(), vocab_size)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / DONE).touch()
    return path


def tiny_checkpoint_once(path: Path, timeout_s: float = 600.0) -> Path:
    """Rank 0 of each node creates it; the other ranks wait for it (no process group exists yet)."""
    if (path / DONE).is_file():
        return path
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        return make_tiny_checkpoint(path)
    deadline = time.monotonic() + timeout_s
    while not (path / DONE).is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not create {path} in {timeout_s:.0f} s")
        time.sleep(0.5)
    return path


def build_datasets(tokenizer: Any, seq_len: int, num_train: int, num_eval: int) -> tuple[Any, Any]:
    """Python's documentation as consecutive blocks of seq_len tokens, documents separated by eos."""
    import datasets

    from dsx3d.data import python_docs_documents

    ids: list[int] = []
    for doc in python_docs_documents():
        ids += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= (num_train + num_eval) * seq_len:
            break
    blocks = [ids[i * seq_len : (i + 1) * seq_len] for i in range(num_train + num_eval)]
    return (
        datasets.Dataset.from_dict({"input_ids": blocks[:num_train]}),
        datasets.Dataset.from_dict({"input_ids": blocks[num_train:]}),
    )


def layout_of(ds_config: str) -> dict[str, Any]:
    """What TrainingArguments must agree with: the DeepSpeed JSON `dsx3d config` wrote."""
    config = json.loads(Path(ds_config).read_text())
    return {
        "per_device_train_batch_size": config["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": config["gradient_accumulation_steps"],
        "max_grad_norm": config["gradient_clipping"],
        "bf16": config["dsx3d"]["dtype"] == "bf16",
        "seq_len": config["dsx3d"]["seq_len"],
    }


def training_arguments(
    output_dir: Path, layout: dict[str, Any], steps: int, lr: float, seed: int, **extra: Any
) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=layout["per_device_train_batch_size"],
        gradient_accumulation_steps=layout["gradient_accumulation_steps"],
        max_grad_norm=layout["max_grad_norm"],
        bf16=layout["bf16"],
        max_steps=steps,
        learning_rate=lr,
        weight_decay=0.01,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=seed,
        disable_tqdm=True,
        **extra,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF checkpoint directory (default: create a tiny Llama)")
    p.add_argument(
        "--ds-config",
        help=f"`dsx3d config` JSON (default: ${ACCELERATE_CONFIG_ENV}, set by accelerate launch)",
    )
    p.add_argument("--output-dir", default="runs/example-trainer")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument(
        "--meta",
        action="store_true",
        help="build the model on the meta device: each rank reads only its slice",
    )
    p.add_argument("--log-json", help="write the Trainer's log history here (rank 0)")
    p.add_argument("--make-tiny", metavar="DIR", help="only create the tiny checkpoint in DIR, then exit")
    args = p.parse_args()
    if args.make_tiny:
        print(make_tiny_checkpoint(Path(args.make_tiny)))
        return

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

    output_dir = Path(args.output_dir)
    model_dir = Path(args.model) if args.model else tiny_checkpoint_once(output_dir / "tiny-llama")
    ds_config = args.ds_config or os.environ.get(ACCELERATE_CONFIG_ENV)
    if not ds_config:
        p.error(
            f"pass --ds-config (from `dsx3d config RECIPE`) or launch with accelerate, which sets ${ACCELERATE_CONFIG_ENV}"
        )
    layout = layout_of(ds_config)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_set, eval_set = build_datasets(tokenizer, layout["seq_len"], args.train_samples, args.eval_samples)
    if args.meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)

    trainer = Trainer(
        model=model,
        args=training_arguments(
            output_dir / "run", layout, args.steps, args.lr, args.seed, deepspeed=args.ds_config
        ),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(output_dir / "final"))
    if trainer.is_world_process_zero():
        layout_text = f"dp {trainer.layout.dp} x tp {trainer.layout.tp} x pp {trainer.layout.pp}"
        print(f"{layout_text}: eval loss {before:.4f} -> {after:.4f}; model in {output_dir / 'final'}")
        if args.log_json:
            Path(args.log_json).write_text(
                json.dumps(
                    {"log_history": trainer.state.log_history, "eval_before": before, "eval_after": after}
                )
            )


if __name__ == "__main__":
    main()
