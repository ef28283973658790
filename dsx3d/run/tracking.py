"""Experiment tracking for `dsx3d train` (`train.report_to`), through DeepSpeed's monitors.

Each logged step's record goes to every backend named in `train.report_to`: TensorBoard event files in
OUTPUT_DIR/tensorboard/, CSV files in OUTPUT_DIR/csv/ (one file per figure, DeepSpeed's csv_monitor) and
Weights & Biases (offline by default: files in OUTPUT_DIR/wandb/, `wandb sync` uploads them; set
WANDB_MODE=online to stream). The monitors are DeepSpeed's own (deepspeed.monitor), the ones its engine uses
for its `tensorboard` / `wandb` / `csv_monitor` config sections; dsx3d drives them itself so that they log the
run's figures (loss, learning rate, gradient norm, tokens/s, TFLOP/s per device), not only the engine's loss.
Only rank 0 writes, as for metrics.jsonl.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BACKENDS = ("tensorboard", "wandb", "csv")
"""The values of train.report_to besides "none"."""
FIGURES = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "peak_mem_gb", "rewards/accuracies", "rewards/margins")
"""The metrics.jsonl fields each backend receives, as train/<name> at the record's step (rewards/*: DPO)."""
EVAL_FIGURES = {"eval_loss": "eval/loss", "eval_rewards/accuracies": "eval/rewards/accuracies", "eval_rewards/margins": "eval/rewards/margins"}
"""metrics.jsonl fields of evaluations and their names in the backends."""


def monitor_sections(report_to: Sequence[str], output_dir: Path, job_name: str) -> dict[str, Any]:
    """DeepSpeed monitor config sections for `report_to` (the keys deepspeed.monitor.config reads)."""
    sections: dict[str, Any] = {}
    if "tensorboard" in report_to:
        sections["tensorboard"] = {"enabled": True, "output_path": str(output_dir / "tensorboard"), "job_name": job_name}
    if "csv" in report_to:
        sections["csv_monitor"] = {"enabled": True, "output_path": str(output_dir / "csv"), "job_name": job_name}
    if "wandb" in report_to:
        sections["wandb"] = {"enabled": True, "project": "dsx3d", "group": job_name}
    return sections


class Tracker:
    """The backends of `report_to` on the reporting rank; does nothing elsewhere or for "none"."""

    def __init__(self, report_to: Sequence[str], output_dir: Path, job_name: str, enabled: bool, fresh: bool = True):
        """`fresh`: a run that starts at step 0 replaces the files of an earlier run (CSV files are appended
        to, so a resumed run adds to its own)."""
        self._monitor: Any = None
        sections = monitor_sections(report_to, output_dir, job_name)
        if not (enabled and sections):
            return
        if fresh:
            for key in ("tensorboard", "csv_monitor"):
                if key in sections:
                    shutil.rmtree(Path(sections[key]["output_path"]) / job_name, ignore_errors=True)
        if "wandb" in sections:
            os.environ.setdefault("WANDB_MODE", "offline")  # no network unless asked for
            os.environ.setdefault("WANDB_DIR", str(output_dir))
            (output_dir / "wandb").mkdir(parents=True, exist_ok=True)
        from deepspeed.monitor.config import get_monitor_config
        from deepspeed.monitor.monitor import MonitorMaster

        self._monitor = MonitorMaster(get_monitor_config(sections))

    def log(self, record: dict[str, Any]) -> None:
        if self._monitor is not None:
            step = int(record["step"])
            events = [(f"train/{k}", float(record[k]), step) for k in FIGURES if k in record]
            events += [(name, float(record[k]), step) for k, name in EVAL_FIGURES.items() if k in record]
            self._monitor.write_events(events)

    def close(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        if monitor.tb_monitor is not None and monitor.tb_monitor.summary_writer is not None:
            monitor.tb_monitor.summary_writer.close()
        if monitor.wandb_monitor is not None:
            import wandb

            wandb.finish()
