"""What rank 0 shows while training: a tqdm bar (step, loss, tokens/s, TFLOP/s per device, ETA) and a log
line every train.log_interval steps, written above the bar so neither garbles the other."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dsx3d.run.metrics import MetricsLog, Throughput

log = logging.getLogger("dsx3d")

# Not on a terminal (CI, a log file) a bar is redrawn as new lines: redraw it rarely there.
_MININTERVAL_TTY_S = 0.5
_MININTERVAL_PIPE_S = 30.0


class TqdmHandler(logging.Handler):
    """A logging handler that prints through tqdm.write, above any open bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class Progress:
    """The bar; a no-op on every rank but the one that reports."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self._bar: Any = None
        if enabled:
            tty = sys.stderr.isatty()
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=_MININTERVAL_TTY_S if tty else _MININTERVAL_PIPE_S,
            )

    def update(self, loss: float, tokens_per_s: float, tflops: float) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s, {tflops:.3g} TFLOP/s/dev", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def format_log_line(record: dict[str, Any], total_steps: int) -> str:
    """One line per log_interval, from a metrics.jsonl record."""
    return (
        f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} (avg {record['loss_avg']:.4f}) | "
        f"lr {record['lr']:.3e} | grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
        f"{record['tflops_per_device']:.3g} TFLOP/s/device | {record['elapsed_s']:.0f} s"
    )


class Reporter:
    """Per step: the bar. Every `log_interval` steps and at the last one: a metrics.jsonl record and a log
    line. Only the reporting rank (rank 0) writes anything; every rank has the loss (DeepSpeed broadcasts
    it) and the global gradient norm."""

    def __init__(
        self, metrics_path: Path, total_steps: int, start_step: int, log_interval: int, throughput: Throughput, enabled: bool
    ):
        self.total_steps, self.log_interval, self.throughput, self.enabled = total_steps, log_interval, throughput, enabled
        self.progress = Progress(total_steps, start_step, enabled)
        self.metrics = MetricsLog(metrics_path) if enabled else None
        self.started = time.perf_counter()
        self._losses: list[float] = []
        self._seconds = 0.0

    def step(self, step: int, loss: float, lr: float, grad_norm: float, seconds: float) -> None:
        if not self.enabled:
            return
        self._losses.append(loss)
        self._seconds += seconds
        n = len(self._losses)
        self.progress.update(loss, self.throughput.tokens_per_s(n, self._seconds), self.throughput.tflops_per_device(n, self._seconds))
        if step % self.log_interval == 0 or step == self.total_steps:
            record = {
                "step": step,
                "loss": loss,
                "loss_avg": sum(self._losses) / n,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": self.throughput.tokens_per_s(n, self._seconds),
                "tflops_per_device": self.throughput.tflops_per_device(n, self._seconds),
                "tokens": step * self.throughput.tokens_per_step,
                "step_time_s": self._seconds / n,
                "elapsed_s": time.perf_counter() - self.started,
                "time": time.time(),
            }
            assert self.metrics is not None
            self.metrics.write(record)
            log.info("%s", format_log_line(record, self.total_steps))
            self._losses, self._seconds = [], 0.0

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
