"""The loss curve of a run, drawn from metrics.jsonl (so it spans resumes) with matplotlib's Agg backend."""

from __future__ import annotations

import logging
from pathlib import Path

from dsx3d.fsio import make_dirs, share_tree
from dsx3d.run.metrics import read_metrics


def plot_loss(metrics_path: Path, out_path: Path, title: str) -> Path | None:
    """Write the curve to `out_path`; None when there is nothing to draw."""
    records = read_metrics(metrics_path)
    if not records:
        return None
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # "generated new fontManager" on a fresh cache
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in records], marker=".", label="loss at the logged step")
    ax.plot(steps, [r["loss_avg"] for r in records], label="mean over the log interval")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="o", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    make_dirs(out_path.parent)
    try:
        fig.savefig(out_path, dpi=100)
    except OSError as err:  # PIL's writer drops the file name: a full disk said without saying where
        raise OSError(err.errno, err.strerror or str(err), str(out_path)) from None
    finally:
        plt.close(fig)
    share_tree(out_path)
    return out_path
