"""Sweep: N seeded TrainingArguments draws, each trained by transformers.Trainer and dsx3d.Trainer and compared.

Usage: python -m scripts.conformance [N] [--seed S] [--optim NAME ...]   (from the repository root)
Prints one line per draw (equal / refused with the reason / different with what differs) and the counts.
Exit status 1 when any draw differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draws", type=int, nargs="?", default=50)
    parser.add_argument("--seed", type=int, default=0, help="draw i uses seed + i")
    parser.add_argument("--optim", nargs="*", default=None, help="draw the optimizer among these (default: every OptimizerNames)")
    opts = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from dsx3d.verify.harness import warm_up
    from tests.helpers.conformance import draw, run_draw, save_tiny_model

    warm_up()
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dsx3d-conformance-") as tmp:
        model_dir = save_tiny_model(Path(tmp) / "model")
        for i in range(opts.draws):
            seed = opts.seed + i
            case = draw(seed, opts.optim)
            start = time.monotonic()
            verdict, details = run_draw(Path(tmp) / f"draw{seed}", model_dir, case)
            counts[verdict] = counts.get(verdict, 0) + 1
            reason = next((line.strip() for line in details[0].splitlines() if "TrainingArguments." in line or "Trainer(" in line),
                          details[0].splitlines()[-1]) if details else ""  # fmt: skip
            print(f"seed {seed}: {verdict} ({time.monotonic() - start:.1f}s){' :: ' + reason if reason else ''}\n"
                  f"    layout={case['layout']} rows={case['rows']} eval_rows={case['eval_rows']} args={case['args']}", flush=True)  # fmt: skip
            for line in details[1:] if verdict == "different" else []:
                print(f"    {line}", flush=True)
    print("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
    return 1 if counts.get("different") else 0


if __name__ == "__main__":
    sys.exit(main())
