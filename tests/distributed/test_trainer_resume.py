"""dsx3d.Trainer resumed from its own checkpoints trains exactly like the uninterrupted run: every remaining
step's loss, learning rate (the rate the engine stepped with) and gradient norm, and the final evaluation.
Resumed mid-epoch (HF skips the epoch's first batches) and at an epoch boundary (HF restores the RNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import (
    eval_set,
    step_values,
    tiny_llama,
    train_set,
    training_args,
    write_ds_config,
)

pytestmark = pytest.mark.usefixtures("warm")

STEPS = 6
SAMPLES = 16  # 4 optimizer steps per epoch at dp 1 (micro 2 x accumulation 2): step 4 ends an epoch
RESUME_AT = (2, 4)


def _args(out: Path, ds_config: Path, **extra: Any) -> Any:
    return training_args(
        out,
        deepspeed=str(ds_config),
        max_steps=STEPS,
        warmup_steps=2,
        lr_scheduler_type="cosine",  # a rate that changes every step: a stale engine rate shows at once
        save_strategy="steps",
        save_steps=2,
        **extra,
    )


def _history(trainer: Any) -> dict[str, Any]:
    return {
        key: step_values(trainer.state.log_history, key) for key in ("loss", "learning_rate", "grad_norm")
    } | {"eval": trainer.evaluate()["eval_loss"]}


def _resume_worker(rank: int, work: Path, ds_config: Path) -> dict[str, Any]:
    import dsx3d

    full = dsx3d.Trainer(
        model=tiny_llama(), args=_args(work / "full", ds_config), train_dataset=train_set(SAMPLES), eval_dataset=eval_set()
    )
    full.train()
    out = {"full": _history(full)}
    for step in RESUME_AT:
        resumed = dsx3d.Trainer(
            model=tiny_llama(),
            args=_args(work / f"resumed-{step}", ds_config),
            train_dataset=train_set(SAMPLES),
            eval_dataset=eval_set(),
        )
        resumed.train(resume_from_checkpoint=str(work / "full" / f"checkpoint-{step}"))
        out[step] = _history(resumed)
    return out


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 1)], ids=lambda t: f"dp{t[0]}-tp{t[1]}-pp{t[2]}")
def test_resume_matches_the_uninterrupted_run_at_every_step(tmp_path: Path, layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    ds_config = write_ds_config(tmp_path / "ds.json", dp, tp, pp)
    r = run_ranks(_resume_worker, dp * tp * pp, tmp_path, ds_config)[0]
    full = r["full"]
    assert len(full["loss"]) == STEPS and len(set(full["learning_rate"])) >= STEPS - 1, full
    for step in RESUME_AT:
        resumed = r[step]
        for key in ("loss", "learning_rate", "grad_norm"):
            # the resumed log holds the checkpoint's history (steps 1 .. step), then the steps it trained
            assert len(resumed[key]) == STEPS, (step, key, resumed[key])
            worst = max(abs(a - b) for a, b in zip(full[key][step:], resumed[key][step:], strict=True))
            assert worst <= 1e-6, (step, key, full[key], resumed[key])
        assert abs(full["eval"] - resumed["eval"]) <= 1e-6, (step, full["eval"], resumed["eval"])
