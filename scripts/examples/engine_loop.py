"""Your own training loop on dsx3d's engine: any layout (dp x tp x pp), under any launcher.

    python scripts/examples/engine_loop.py RECIPE.yaml                                  # one process
    accelerate launch --config_file accelerate.yaml scripts/examples/engine_loop.py RECIPE.yaml
    torchrun --nproc_per_node N scripts/examples/engine_loop.py RECIPE.yaml

A pipeline runs a whole optimizer step at once (every micro-batch through every stage), so the loop hands the
engine one step's micro-batches instead of calling forward and backward itself: `engine.train_step(iterator)`
returns the step's loss (the same on every rank); `engine.lr` and `engine.grad_norm` are the step's rate and
global gradient norm. The data here is the recipe's (`data.*`), sharded by data-parallel rank; any iterator of
(input_ids, labels) tensors of shape (train.micro_batch_size, train.seq_len) will do.
"""

from __future__ import annotations

import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> list[float]:
    from dsx3d.data import build_train_data
    from dsx3d.distributed import comm
    from dsx3d.engine.builder import build_engine
    from dsx3d.recipe.schema import load_recipe

    recipe = load_recipe((argv if argv is not None else sys.argv[1:])[0])
    if not comm.is_initialized():  # a launcher's environment, else a process group of one
        if "RANK" in os.environ:
            comm.init_distributed()
        else:
            comm.init_single_process(tempfile.mkdtemp(prefix="dsx3d-pg-"))
    engine = build_engine(recipe)
    stream, _ = build_train_data(recipe, engine.layout.dp, engine.placement.dp)
    losses = []
    for step in range(1, recipe.train.steps + 1):
        micro_batches = [next(stream) for _ in range(recipe.train.gradient_accumulation_steps)]
        losses.append(engine.train_step(iter(micro_batches)))
        if comm.get_rank() == 0:
            print(f"step {step}: loss {losses[-1]:.4f}, lr {engine.lr:.3e}, grad norm {engine.grad_norm:.3f}")
    return losses


if __name__ == "__main__":
    main()
