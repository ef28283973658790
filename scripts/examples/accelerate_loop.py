"""accelerate's own training loop (prepare, backward, step) with a dsx3d config: what works and what is refused.

    dsx3d accelerate-config RECIPE.yaml -o accelerate.yaml
    accelerate launch --config_file accelerate.yaml scripts/examples/accelerate_loop.py --model DIR [--steps N]

A layout with tp 1 and pp 1 (data parallel, ZeRO 0-3) is plain accelerate + DeepSpeed: this loop trains as
accelerate documents it (DummyOptim because the JSON has an optimizer section; the JSON has no scheduler, so the
loop hands DeepSpeed HF's schedule through DummyScheduler's lr_scheduler_callable, as `dsx3d train` does).
A layout with tp > 1 or pp > 1 is refused at `accelerator.prepare` with a dsx3d error that says what to use
instead (dsx3d.Trainer, `-m dsx3d.train`, or the engine loop in engine_loop.py): accelerate's loop runs one
whole model replica per process. The check is installed by `patches.install()` below (or by importing
dsx3d.Trainer); without it DeepSpeed stops at prepare with its own train_batch_size assertion.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local HF checkpoint directory")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=32)
    args = p.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler
    from transformers import AutoModelForCausalLM, get_scheduler

    from dsx3d.integrations import patches

    patches.install()  # dsx3d: Accelerator.prepare refuses a tp/pp layout with a clear message
    accelerator = Accelerator()
    ds_config: dict[str, Any] = accelerator.state.deepspeed_plugin.deepspeed_config
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    model = AutoModelForCausalLM.from_pretrained(args.model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(accelerator.process_index)
    samples = args.steps * accumulation * micro
    ids = torch.randint(0, vocab, (samples, args.seq_len), generator=g)
    loader = torch.utils.data.DataLoader([{"input_ids": t, "labels": t} for t in ids], batch_size=micro)
    optimizer = (DummyOptim if "optimizer" in ds_config else torch.optim.AdamW)(model.parameters(), lr=args.lr)
    if "scheduler" in ds_config:  # a DeepSpeed schedule the user wrote into the JSON
        scheduler = DummyScheduler(optimizer)
    else:  # HF's cosine schedule over the optimizer DeepSpeed builds, stepped by the engine at each optimizer step
        scheduler = DummyScheduler(
            optimizer,
            lr_scheduler_callable=lambda opt: get_scheduler(
                "cosine", opt, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps
            ),
        )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    model.train()
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)  # DeepSpeed accumulates and steps at its boundary
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    accelerator.print(f"micro-batch losses: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
