"""What rank 0 shows while training: a tqdm bar (steps, loss, tokens/s, TFLOP/s per device, ETA) and a log
line at the first step, every train.log_interval steps and at the last, written above the bar so neither
garbles the other. Off a terminal (CI, a log file) the bar is left out: there its redraws would become
lines of their own, and the log lines already carry the same figures and the ETA."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dsx3d.run.memory import MemoryRecord
from dsx3d.run.metrics import MetricsLog, Throughput
from dsx3d.run.tracking import Tracker

log = logging.getLogger("dsx3d")


class TqdmHandler(logging.Handler):
    """A logging handler that prints through tqdm.write, above any open bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class Progress:
    """The bar, on a terminal; a no-op elsewhere and on every rank but the reporting one."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def update(self, loss: float, tokens_per_s: float, tflops: float, peak_gb: float | None = None) -> None:
        if self._bar is not None:
            mem = f", peak {peak_gb:.2f} GB" if peak_gb is not None else ""
            self._bar.set_postfix_str(
                f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s, {tflops:.3g} TFLOP/s/dev{mem}", refresh=False
            )
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_log_line(record: dict[str, Any], total_steps: int) -> str:
    """The log line of a metrics.jsonl record."""
    return (
        f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} (avg {record['loss_avg']:.4f}) | "
        f"lr {record['lr']:.3e} | grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
        f"{record['tflops_per_device']:.3g} TFLOP/s/device | elapsed {format_duration(record['elapsed_s'])} | "
        f"eta {format_duration(record['eta_s'])}"
        + (f" | padding {record['padding_fraction']:.1%}" if "padding_fraction" in record else "")
        + (_memory_text(record["peak_mem_gb"], record["peak_mem_rank"], record["peak_mem_gb_by_stage"]) if "peak_mem_gb" in record else "")
        + (f" | rewards/accuracies {record['rewards/accuracies']:.3f}" if "rewards/accuracies" in record else "")
        + (f" | eval_loss {record['eval_loss']:.4f}" if "eval_loss" in record else "")
        + (f" | eval_rewards/accuracies {record['eval_rewards/accuracies']:.3f}" if "eval_rewards/accuracies" in record else "")
    )


def _memory_text(peak_gb: float, rank: int, stages: list[float]) -> str:
    per_stage = f" (stages {' / '.join(f'{gb:.2f}' for gb in stages)})" if len(stages) > 1 else ""
    return f" | peak mem {peak_gb:.2f} GB on rank {rank}{per_stage}"


class Reporter:
    """Per step: the bar. At the first step, every `log_interval` steps and at the last: a metrics.jsonl
    record and a log line. Only the reporting rank (rank 0) writes anything; every rank knows the loss
    (DeepSpeed broadcasts it) and the global gradient norm.

    Record fields: step, loss (of that step), loss_avg (mean since the previous record), lr (the rate the
    step used), grad_norm (global, before clipping), tokens_per_s and tflops_per_device (over the steps
    since the previous record), tokens (trained so far), step_time_s, elapsed_s (since this process
    started training), eta_s, time (unix), padding_fraction (of the logged step's global batch: the share of its
    tokens that are padding, 0 for text blocks); and eval_loss at the steps that evaluated (the per-token mean
    loss on the held-out data; an evaluation also forces a record at its step); given each rank's peak memory
    of the interval (`dsx3d.run.memory`): peak_mem_gb (the largest over ranks), peak_mem_rank (whose),
    peak_mem_gb_by_stage (the largest of each pipeline stage's ranks), peak_mem_gb_by_rank, peak_mem_kind
    (what was measured: device_allocated, rss_interval or rss_process)."""

    def __init__(
        self,
        metrics_path: Path,
        total_steps: int,
        start_step: int,
        log_interval: int,
        throughput: Throughput,
        enabled: bool,
        tracker: Tracker | None = None,
    ):
        self.total_steps, self.start_step, self.log_interval = total_steps, start_step, log_interval
        self.throughput, self.enabled = throughput, enabled
        self.progress = Progress(total_steps, start_step, enabled)
        self.metrics = MetricsLog(metrics_path) if enabled else None
        self.tracker = tracker  # train.report_to: the same records, to TensorBoard / W&B / CSV
        self.started = time.perf_counter()
        self._losses: list[float] = []
        self._seconds = 0.0

    def step(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        seconds: float,
        eval_loss: float | None = None,
        padding: float | None = None,
        memory: MemoryRecord | None = None,
        extra: dict[str, float] | None = None,
    ) -> None:
        """`extra`: the objective's own metrics of the step (DPO: TRL's rewards/*, logps/*, ...), recorded as given."""
        if self.metrics is None:
            return
        self._losses.append(loss)
        self._seconds += seconds
        n = len(self._losses)
        tokens_per_s = self.throughput.tokens_per_s(n, self._seconds)
        tflops = self.throughput.tflops_per_device(n, self._seconds)
        self.progress.update(loss, tokens_per_s, tflops, memory.peak_gb if memory is not None else None)
        if self.due(step, eval_loss is not None):
            elapsed = time.perf_counter() - self.started
            record: dict[str, object] = {
                "step": step,
                "loss": loss,
                "loss_avg": sum(self._losses) / n,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "tflops_per_device": tflops,
                "tokens": step * self.throughput.tokens_per_step,
                "step_time_s": self._seconds / n,
                "elapsed_s": elapsed,
                "eta_s": elapsed / (step - self.start_step) * (self.total_steps - step),
                "time": time.time(),
            }
            if padding is not None:
                record["padding_fraction"] = padding
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
            if memory is not None:
                record.update(memory.fields())
            record.update(extra or {})
            self.metrics.write(record)
            if self.tracker is not None:
                self.tracker.log(record)
            log.info("%s", format_log_line(record, self.total_steps))
            self._losses, self._seconds = [], 0.0

    def due(self, step: int, evaluated: bool) -> bool:
        """Whether `step` writes a record (the same answer on every rank)."""
        return evaluated or step == self.start_step + 1 or step % self.log_interval == 0 or step == self.total_steps

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.tracker is not None:
            self.tracker.close()
