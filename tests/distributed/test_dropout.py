"""Dropout under tensor parallelism (dsx3d.distributed.tensor_parallel.random), on forked gloo ranks with a
seed_oss model (attention dropout inside each rank's heads, residual dropout on the replicated stream):

- without sequence parallelism, replicated activations get identical masks on every TP rank: the hidden
  states after every decoder layer are equal across the TP group, and so is every mask drawn outside a TP
  region; sharded activations (a rank's own attention heads) get independent masks: the attention-weight
  masks of the two TP ranks differ;
- with sequence parallelism every activation of a decoder layer is per-rank (a rank's slice of the sequence,
  or its heads): every mask is drawn from the rank's own stream and the two ranks' masks differ;
- activation-checkpoint recomputation redraws the same masks (losses and gradient norms equal with and
  without checkpointing), and a resumed run continues every stream exactly (restoring each rank's RNG
  state, as `dsx3d train --resume` does, gives the uninterrupted run's next losses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import (
    ParityCase,
    build_case_engine,
    case_recipe,
    make_batches,
    micro_batch,
)

pytestmark = pytest.mark.usefixtures("warm")

P = 0.1


def _case(**kw: Any) -> ParityCase:  # sequence parallelism on unless kw says otherwise
    config = tiny_config("seed_oss", attention_dropout=P, residual_dropout=P, attn_implementation="eager")
    return ParityCase(config, dp=1, tp=2, pp=2, steps=3, **kw)


def _micro(case: ParityCase, batch: torch.Tensor, dp_rank: int) -> Any:
    return iter([(ids, ids) for ids in (micro_batch(case, batch, k, dp_rank) for k in range(case.micro_batches))])


def _masks_worker(rank: int, case: ParityCase, batches: torch.Tensor) -> dict[str, Any]:
    from dsx3d.models.pipe_layers import DecoderLayerPipe

    engine = build_case_engine(case)
    tp_random = engine.module.dsx3d_builder.tp.random
    assert tp_random.active
    masks: list[tuple[bool, torch.Tensor, torch.Tensor]] = []  # (in a TP region, dropped, inputs != 0)
    real_dropout = F.dropout

    def recording_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        out = real_dropout(x, p, training, inplace)
        if training and p > 0:
            masks.append((tp_random.in_sharded_region, ((out == 0) & (x != 0)).detach().clone(), (x != 0).sum()))
        return out

    hidden: list[torch.Tensor] = []
    for layer in engine.module.forward_funcs:
        if isinstance(layer, DecoderLayerPipe):
            layer.register_forward_hook(lambda mod, args, out: hidden.append(out[0].detach().clone()))
    F.dropout = recording_dropout  # type: ignore[assignment]
    try:
        engine.train_step(_micro(case, batches[0], engine.placement.dp))
    finally:
        F.dropout = real_dropout  # type: ignore[assignment]
    return {"pp": engine.placement.pp, "hidden": hidden, "masks": masks}


def test_replicated_masks_equal_and_head_masks_independent_across_tp() -> None:
    case = _case(sequence_parallel=False)
    results = run_ranks(_masks_worker, case.world_size, case, make_batches(case))
    for stage in (0, 1):
        a, b = [r for r in results if r["pp"] == stage]  # the two TP ranks of this stage
        assert len(a["hidden"]) == len(b["hidden"]) > 0
        for ha, hb in zip(a["hidden"], b["hidden"], strict=True):
            torch.testing.assert_close(ha, hb, rtol=0, atol=0)  # replicated states stay identical
        pairs = list(zip(a["masks"], b["masks"], strict=True))
        assert all(ra[0] == rb[0] for ra, rb in pairs)  # both ranks draw in the same places
        sharded = [(ra, rb) for ra, rb in pairs if ra[0]]
        replicated = [(ra, rb) for ra, rb in pairs if not ra[0]]
        assert sharded and replicated  # attention-weight dropout inside the heads, residual dropout outside
        for ra, rb in replicated:
            assert torch.equal(ra[1], rb[1])
        for ra, rb in sharded:
            assert not torch.equal(ra[1], rb[1])  # independent masks for different heads
        for r in (a, b):
            dropped = sum(int(m[1].sum()) for m in r["masks"]) / sum(int(m[2]) for m in r["masks"])
            assert 0.07 < dropped < 0.13  # dropout at p = 0.1


def test_sequence_parallel_masks_are_per_rank() -> None:
    case = _case()
    results = run_ranks(_masks_worker, case.world_size, case, make_batches(case))
    for stage in (0, 1):
        a, b = [r for r in results if r["pp"] == stage]
        assert a["hidden"][0].shape[1] == case.seq_len // 2  # the layers ran on sequence shards
        pairs = list(zip(a["masks"], b["masks"], strict=True))
        assert pairs and all(ra[0] and rb[0] for ra, rb in pairs)  # every mask from the rank's own stream
        for ra, rb in pairs:
            assert not torch.equal(ra[1], rb[1])
        for r in (a, b):
            dropped = sum(int(m[1].sum()) for m in r["masks"]) / sum(int(m[2]) for m in r["masks"])
            assert 0.07 < dropped < 0.13


def _train_worker(rank: int, case: ParityCase, batches: torch.Tensor, ckpt_dir: str | None) -> dict[str, Any]:
    from dsx3d.checkpoint.training.checkpointer import Checkpointer

    engine = build_case_engine(case)
    losses, norms = [], []
    for step, batch in enumerate(batches):
        if ckpt_dir is not None and step == 1:
            ckpt = Checkpointer(engine, Path(ckpt_dir), case_recipe(case), keep=1)
            ckpt.save(1, {"step": 1})
        losses.append(engine.train_step(_micro(case, batch, engine.placement.dp)))
        norms.append(engine.grad_norm)
    return {"losses": losses, "norms": norms}


def _resume_worker(rank: int, case: ParityCase, batches: torch.Tensor, ckpt_dir: str) -> list[float]:
    from dsx3d.checkpoint.training.checkpointer import Checkpointer

    engine = build_case_engine(case)
    torch.manual_seed(12345)  # a fresh process's stream: the resume must replace it
    assert Checkpointer(engine, Path(ckpt_dir), case_recipe(case), keep=1).load_latest() is not None
    return [engine.train_step(_micro(case, batch, engine.placement.dp)) for batch in batches[1:]]


def test_recomputation_and_resume_redraw_the_same_masks(tmp_path: Path) -> None:
    case = _case()
    batches = make_batches(case)
    plain = run_ranks(_train_worker, case.world_size, case, batches, str(tmp_path / "ckpt"))[0]
    ckpt = _case(activation_checkpointing=True)
    recomputed = run_ranks(_train_worker, ckpt.world_size, ckpt, batches, None)[0]
    assert recomputed["losses"] == pytest.approx(plain["losses"], abs=1e-6, rel=0)
    assert recomputed["norms"] == pytest.approx(plain["norms"], abs=1e-5, rel=0)
    resumed = run_ranks(_resume_worker, case.world_size, case, batches, str(tmp_path / "ckpt"))[0]
    assert resumed == pytest.approx(plain["losses"][1:], abs=1e-6, rel=0)
    # and dropout is on: without it the losses differ
    no_dropout = ParityCase(tiny_config("seed_oss", attention_dropout=0.0, residual_dropout=0.0), dp=1, tp=2, pp=2, steps=3)
    off = run_ranks(_train_worker, case.world_size, no_dropout, batches, None)[0]
    assert abs(off["losses"][0] - plain["losses"][0]) > 1e-4
