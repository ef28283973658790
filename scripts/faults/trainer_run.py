"""The training script the Trainer face of the fault campaign launches: a tiny Llama through `dsx3d.Trainer`, as
a user runs one under the deepspeed launcher (the layout, pp 2, comes from the recipe):

    python -m deepspeed.launcher.runner --num_gpus 2 scripts/faults/trainer_run.py --out DIR --recipe R.yaml [--resume]

A checkpoint every SAVE_STEPS steps, two kept. `--resume` continues from the newest complete checkpoint when
the output directory holds any (as run_clm does with get_last_checkpoint). A stop signal saves and exits
128 + the signal; errors go through `dsx3d.handle_errors()` (a UserError: exit 2). At the end: the final model
(DIR/final) and DIR/trainer_state.json. Rank 0 appends each finished step to DIR/steps.txt, so the campaign
can aim its faults (--steps-file: elsewhere, off a disk the campaign fills); a peer silent for
--hang-timeout-s (10) is named as hung.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

STEPS = 24
SAVE_STEPS = 4
SEQ = 32
MICRO = 2  # rows per micro-batch
ACCUM = 4  # micro-batches per step
VOCAB = 128
DIMS = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
"""Wide enough that a step takes a while (about 0.1 s on one core), so faults land at many moments of it."""


def _dataset(samples: int) -> Any:
    import datasets
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--recipe", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--steps-file", type=Path, default=None, help="where rank 0 appends each finished step (default OUT/steps.txt)")
    p.add_argument("--hang-timeout-s", type=float, default=10.0, help="Trainer.hang_timeout_s")
    args, _ = p.parse_known_args(argv)  # the launcher appends --local_rank=N

    import torch
    from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments

    import dsx3d
    from dsx3d import Trainer  # before TrainingArguments: it then accepts a recipe path
    from dsx3d.models.known_families import tiny_config

    class Progress(TrainerCallback):
        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                with (args.steps_file or args.out / "steps.txt").open("a") as f:
                    f.write(f"{state.global_step}\n")

    torch.set_num_threads(1)
    with dsx3d.handle_errors():
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config("llama", tie_word_embeddings=False, **DIMS))
        training = TrainingArguments(
            output_dir=str(args.out),
            deepspeed=args.recipe,
            max_steps=STEPS,
            learning_rate=2e-3,
            warmup_steps=2,
            lr_scheduler_type="cosine",
            logging_steps=1,
            save_strategy="steps",
            save_steps=SAVE_STEPS,
            save_total_limit=2,
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=model, args=training, train_dataset=_dataset(96), callbacks=[Progress()])
        trainer.hang_timeout_s = args.hang_timeout_s
        resume = args.resume and any(args.out.glob("checkpoint-*"))
        trainer.train(resume_from_checkpoint=True if resume else None)
        if trainer.preemption.preempted is not None:
            return 128 + trainer.preemption.preempted[0]
        trainer.save_model(str(args.out / "final"))
        trainer.save_state()
    return 0


if __name__ == "__main__":
    sys.exit(main())
