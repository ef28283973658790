"""dsx3d.Trainer preempted: a SIGTERM to one rank during a seeded random step makes every rank save
checkpoint-<that step> through HF's TrainerControl and end train(); resumed from it, every later loss equals
the uninterrupted run's (dp 1 x tp 2 x pp 2 on forked ranks)."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import step_values, tiny_llama, train_set, training_args, write_ds_config

pytestmark = pytest.mark.usefixtures("warm")

STEPS = 6
WORLD = 4
SEED = int(os.environ.get("DSX3D_FAULT_SEED", "36"))


def _args(out: Path, ds_config: Path) -> Any:
    return training_args(out, deepspeed=str(ds_config), max_steps=STEPS, warmup_steps=2, lr_scheduler_type="cosine")


def _worker(rank: int, work: Path, ds_config: Path, victim: int, at_step: int) -> dict[str, Any]:
    from transformers import TrainerCallback

    import dsx3d

    class SignalAt(TrainerCallback):  # the notice arrives while step `at_step` runs
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if rank == victim and state.global_step + 1 == at_step:
                os.kill(os.getpid(), signal.SIGTERM)

    def trainer(out: str, callbacks: list[Any]) -> Any:
        return dsx3d.Trainer(
            model=tiny_llama(), args=_args(work / out, ds_config), train_dataset=train_set(32), callbacks=callbacks
        )

    full = trainer("full", [])
    full.train()
    stopped = trainer("stopped", [SignalAt()])
    stopped.train()
    preempted = stopped.preemption.preempted
    resumed = trainer("stopped", [])
    resumed.train(resume_from_checkpoint=True)
    return {
        "full": step_values(full.state.log_history, "loss"),
        "stopped_at": stopped.state.global_step,
        "preempted": preempted and (preempted[0], preempted[1], str(preempted[2])),
        "resumed": step_values(resumed.state.log_history, "loss"),
        "handler_restored": signal.getsignal(signal.SIGTERM) is not None
        and getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is None,
    }


def test_a_signal_saves_through_trainer_control_and_the_resume_is_exact(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    victim, at_step = rng.randrange(WORLD), rng.randint(1, STEPS - 1)
    print(f"seed {SEED}: SIGTERM to rank {victim} during step {at_step}")
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 2, 2)
    results = run_ranks(_worker, WORLD, tmp_path, ds_config, victim, at_step, timeout_s=400)
    for r in results:
        assert r["stopped_at"] == at_step and r["handler_restored"], r  # every rank agreed on the step
    r = results[0]
    assert r["preempted"] == (signal.SIGTERM, at_step, str(tmp_path / "stopped" / f"checkpoint-{at_step}"))
    assert (tmp_path / "stopped" / f"checkpoint-{at_step}").is_dir()
    assert len(r["full"]) == STEPS and len(r["resumed"]) == STEPS, r
    worst = max(abs(a - b) for a, b in zip(r["full"], r["resumed"], strict=True))
    assert worst <= 1e-6, (r["full"], r["resumed"])
