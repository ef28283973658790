"""dsx3d.Trainer's faults on forked gloo ranks (dp 1 x tp 1 x pp 2): every checkpoint-N it saves carries a manifest
of every rank's files; a damaged newest checkpoint and an unfinished one are skipped by
resume_from_checkpoint=True, which then trains exactly like the uninterrupted run, and an explicit damaged path
is refused on every rank; a rank whose peer is SIGKILLed names it and exits 1, without a traceback."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from dsx3d.checkpoint.checksums import read_sums
from dsx3d.integrations.trainer_checkpoints import checkpoint_problems, start_save
from dsx3d.verify.harness import RankFailure, run_ranks
from tests.helpers.trainer_helpers import step_values, tiny_llama, train_set, training_args, write_ds_config

pytestmark = pytest.mark.usefixtures("warm")

STEPS = 6


def _trainer(out: Path, ds_config: Path, callbacks: list[Any] | None = None) -> Any:
    import dsx3d

    args = training_args(out, deepspeed=str(ds_config), max_steps=STEPS, save_strategy="steps", save_steps=2)
    return dsx3d.Trainer(model=tiny_llama(), args=args, train_dataset=train_set(32), callbacks=callbacks)


def _train(rank: int, out: Path, ds_config: Path) -> list[float]:
    trainer = _trainer(out, ds_config)
    trainer.train()
    return step_values(trainer.state.log_history, "loss")


def _resume(rank: int, out: Path, ds_config: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    from dsx3d.errors import UserError

    class StartStep(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            started.append(state.global_step)

    started: list[int] = []
    try:
        _trainer(out, ds_config).train(resume_from_checkpoint=str(out / f"checkpoint-{STEPS}"))
        refused = ""
    except UserError as err:
        refused = str(err)
    trainer = _trainer(out, ds_config, [StartStep()])
    trainer.train(resume_from_checkpoint=True)
    return {"refused": refused, "started": started, "losses": step_values(trainer.state.log_history, "loss")}


def test_checkpoints_carry_a_manifest_and_a_damaged_one_is_skipped_exactly(tmp_path: Path) -> None:
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 1, 2)
    out = tmp_path / "run"
    full = run_ranks(_train, 2, out, ds_config)[0]
    for step in range(2, STEPS + 1, 2):
        ckpt = out / f"checkpoint-{step}"
        sums = read_sums(ckpt)
        assert sums is not None and checkpoint_problems(ckpt) == [], ckpt
        assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "scheduler.pt"} <= set(sums), (
            sorted(sums)
        )
        assert {
            f"global_step{step}/mp_rank_00_model_states.pt",
            f"global_step{step}/mp_rank_01_model_states.pt",
        } <= set(sums)
    victim = out / f"checkpoint-{STEPS}" / f"global_step{STEPS}" / "mp_rank_01_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    start_save(out / f"checkpoint-{STEPS - 2}")  # a save of step 4 that a kill interrupted: no manifest
    r = run_ranks(_resume, 2, out, ds_config)[0]
    assert str(victim) in r["refused"] and "truncated" in r["refused"], r["refused"]
    assert r["started"] == [STEPS - 4], r  # checkpoint-2, the newest complete one
    assert (
        len(r["losses"]) == STEPS and max(abs(a - b) for a, b in zip(full, r["losses"], strict=True)) <= 1e-6
    )


def _killed_peer(rank: int, out: Path, ds_config: Path) -> None:
    from transformers import TrainerCallback

    handler = logging.FileHandler(out.parent / f"log-{rank}.txt")
    logging.getLogger("dsx3d").addHandler(handler)

    class KillAtStep3(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if rank == 1 and state.global_step == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    _trainer(out, ds_config, [KillAtStep3()]).train()


def test_a_rank_whose_peer_is_killed_names_it_and_exits_1(tmp_path: Path) -> None:
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 1, 2)
    with pytest.raises(RankFailure) as failure:
        run_ranks(_killed_peer, 2, tmp_path / "run", ds_config, timeout_s=120)
    assert "exit codes: [1, -9]" in str(failure.value) and "ranks failed: []" in str(failure.value), (
        failure.value
    )
    said = (tmp_path / "log-0.txt").read_text()
    assert (
        "rank 0 (" in said and "stopped: rank 1 (" in said and "died" in said and "Traceback" not in said
    ), said
