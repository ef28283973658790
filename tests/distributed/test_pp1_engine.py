"""The engine without a pipeline (parallel.pp = 1): the pipeline items as one plain module on DeepSpeed's
regular engine, with our dp/tp groups as its mpu, so ZeRO-0/1/2/3 all run. Forked gloo ranks, fp32.

- structure: pp = 1 builds a DeepSpeedEngine that is no PipelineEngine, holds TP shards (not the whole
  model), runs the requested ZeRO stage, and with ZeRO-3 keeps parameters partitioned (a silent fall-back to
  the pipeline engine, or a TP-less build, which trains to the same numbers, fails here);
- parity with single-process HF (losses, gradient norms, final weights), a sample in CI and the whole grid
  with DSX3D_SWEEP=1: ZeRO-2 and ZeRO-3 at (dp, tp) = (2,1), (1,2), (2,2) on an untied Llama with GQA and a
  tied Qwen3 with vocabulary 127 (padded at tp 2), clipping active;
- ZeRO-3 at dp 2 x tp 2: the collective HF export (gathering partitions) loads with from_pretrained and gives
  the engine's held-out loss; the offline `dsx3d export` of its checkpoint equals it bit for bit; resuming the
  checkpoint continues with the uninterrupted run's losses; its universal conversion resumes at dp 4 x tp 1
  with the same losses (with DSX3D_SWEEP=1);
- `dsx3d.train.train` at dp 2 x tp 2 x ZeRO-2: resumed from its step-2 checkpoint it trains exactly like the
  uninterrupted run, and the offline export of its checkpoint equals its own export bit for bit.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dsx3d.models.known_families import tiny_config
from dsx3d.recipe.schema import ModelSection, Recipe, dump_recipe, recipe_from_dict
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import (
    ParityCase,
    build_case_engine,
    case_recipe,
    make_batches,
    micro_batch,
    run_parity,
    run_verify,
)
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = pytest.mark.usefixtures("warm")
sweep = pytest.mark.skipif(os.environ.get("DSX3D_SWEEP") != "1", reason="opt-in grid: DSX3D_SWEEP=1")

MODELS = {
    "llama-gqa": lambda: tiny_config("llama", tie_word_embeddings=False),
    "qwen3-tied-oddvocab": lambda: tiny_config("qwen3", tie_word_embeddings=True, vocab_size=127),
}


# -- structure ---------------------------------------------------------------------------------------------


def _structure_rank(rank: int, case: ParityCase) -> dict[str, Any]:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from dsx3d.models.shards import local_shape

    engine = build_case_engine(case)
    params = dict(engine.module.named_parameters())
    q = params["1.layer.self_attn.q_proj.weight"]
    assert engine.mpu is not None
    return {
        "pipeline": isinstance(engine.ds_engine, PipelineEngine),
        "regular": isinstance(engine.ds_engine, DeepSpeedEngine),
        "module": type(engine.module).__name__,
        "zero": engine.ds_engine.zero_optimization_stage(),
        "q_shape": local_shape(q),
        "q_numel_held": q.numel(),
        "q_dtype": getattr(q, "ds_tensor", q).dtype,  # ZeRO-3 keeps this rank's partition in ds_tensor
        "sharded": sorted(n for n, p in params.items() if getattr(p, "tensor_model_parallel", False)),
        "tp": engine.mpu.get_tensor_model_parallel_world_size(),
        "dp": engine.mpu.get_data_parallel_world_size(),
        "engine_dp": engine.ds_engine.dp_world_size,
    }


@pytest.mark.parametrize("stage", [pytest.param(2, marks=sweep), 3])
def test_pp1_is_the_regular_engine_with_tp_shards(stage: int) -> None:
    """bf16 too: ZeRO-3 parameters partitioned while the model is built must be cast first, since the engine
    no longer casts partitioned parameters (they stayed fp32 once, and the bf16 run computed in fp32)."""
    config = MODELS["llama-gqa"]()
    case = ParityCase(config, dp=2, tp=2, pp=1, zero_stage=stage, dtype="bf16")
    full_q = (config.num_attention_heads * config.head_dim, config.hidden_size)
    for r in run_ranks(_structure_rank, case.world_size, case):
        assert not r["pipeline"] and r["regular"] and r["module"] == "SequentialLM", r
        assert r["zero"] == stage and (r["tp"], r["dp"], r["engine_dp"]) == (2, 2, 2), r
        assert r["q_shape"] == (full_q[0] // 2, full_q[1]), r  # a TP shard, not the whole projection
        assert "1.layer.mlp.down_proj.weight" in r["sharded"] and "0.embed.weight" in r["sharded"], r
        held = r["q_numel_held"]
        # ZeRO-3 keeps only a placeholder outside forward/backward; the others hold the whole shard
        assert held == 0 if stage == 3 else held == full_q[0] // 2 * full_q[1], r
        assert r["q_dtype"] == torch.bfloat16, r


# -- parity --------------------------------------------------------------------------------------------------

# Adam amplifies round-off where a gradient element is near eps: Qwen3 (tied, vocab 127) at dp 2 x tp 2 x
# ZeRO-3 moved one weight by 2.06e-5 more than the reference at lr 1e-3 (2.06e-6 at 1e-4, 2.07e-7 at 1e-5,
# after one step, loss difference 0; that element's gradient was 3.6e-9). The weight check of
# dsx3d.verify.parity allows for exactly that amplification, element by element, so every case runs at eps 1e-8.


def _assert_parity(model: str, stage: int, dp: int, tp: int, *, both: bool = False, **kw: Any) -> None:
    """AdamW as training runs it (losses, gradient norms, final weights); with `both` also the SGD run that
    compares every step's gradients tensor by tensor (what `dsx3d verify` does)."""
    case = ParityCase(MODELS[model](), dp=dp, tp=tp, pp=1, zero_stage=stage, **kw)
    for r in run_verify(case) if both else [run_parity(case)]:
        assert r.ok, r.to_dict()
        assert r.losses_ref[0] != r.losses_ref[-1]  # it trained
        if case.grad_clip:  # clipping was active, so a wrongly counted norm would have moved the weights
            assert min(r.grad_norms_ref) > case.grad_clip, r.to_dict()


CI_CASES = [("llama-gqa", 3, 2, 2), ("qwen3-tied-oddvocab", 2, 2, 2)]
GRID = [
    (model, stage, dp, tp)
    for model, stage, (dp, tp) in itertools.product(sorted(MODELS), (2, 3), ((2, 1), (1, 2), (2, 2)))
]


@pytest.mark.parametrize(("model", "stage", "dp", "tp"), CI_CASES, ids=lambda v: str(v))
def test_parity_pp1(model: str, stage: int, dp: int, tp: int) -> None:
    _assert_parity(model, stage, dp, tp, grad_clip=0.5)


@sweep
@pytest.mark.parametrize(("model", "stage", "dp", "tp"), GRID, ids=lambda v: str(v))
def test_parity_pp1_grid(model: str, stage: int, dp: int, tp: int) -> None:
    _assert_parity(model, stage, dp, tp, both=True, grad_clip=0.5)


@sweep
@pytest.mark.parametrize("stage", [0, 1])
def test_parity_pp1_low_stages(stage: int) -> None:
    _assert_parity("qwen3-tied-oddvocab", stage, 2, 2, both=True, grad_clip=0.5)


# -- ZeRO-3: export, offline export, resume, universal ------------------------------------------------------


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _micro(case: ParityCase, batch: torch.Tensor, dp_rank: int) -> Any:
    return iter(
        [(ids, ids) for ids in (micro_batch(case, batch, k, dp_rank) for k in range(case.micro_batches))]
    )


def _save_rank(
    rank: int, case: ParityCase, recipe: Recipe, batches: torch.Tensor, tmp: Path
) -> dict[str, Any]:
    import json

    from dsx3d.checkpoint.hf.export import export_hf
    from dsx3d.checkpoint.training.universal import universal_client_state
    from dsx3d.engine.builder import build_engine

    engine = build_engine(recipe)
    dp_rank = engine.placement.dp
    losses = [engine.train_step(_micro(case, batches[t], dp_rank)) for t in range(2)]
    eval_loss = engine.eval_loss(_micro(case, batches[4], dp_rank))
    tag = tmp / "checkpoints" / "step-000002"
    engine.ds_engine.save_checkpoint(
        str(tag.parent), tag=tag.name, client_state=universal_client_state(engine)
    )
    if rank == 0:  # what the Checkpointer stores with each tag
        (tag / "dsx3d_recipe.yaml").write_text(dump_recipe(recipe))
        (tag / "dsx3d_layout.json").write_text(json.dumps({"dp": case.dp, "tp": case.tp, "pp": case.pp}))
    export_hf(engine, tmp / "export")
    losses += [engine.train_step(_micro(case, batches[t], dp_rank)) for t in (2, 3)]  # the uninterrupted run
    return {"losses": losses, "eval": eval_loss}


def _resume_rank(
    rank: int, case: ParityCase, recipe: Recipe, batches: torch.Tensor, tag: Path, universal: bool
) -> list[float]:
    from dsx3d.checkpoint.training.universal import LOAD_UNIVERSAL
    from dsx3d.engine.builder import build_engine

    engine = build_engine(recipe, ds_overrides=LOAD_UNIVERSAL if universal else None)
    engine.ds_engine.load_checkpoint(str(tag.parent), tag=tag.name)
    return [engine.train_step(_micro(case, batches[t], engine.placement.dp)) for t in (2, 3)]


def test_zero3_export_offline_export_resume_and_universal(tmp_path: Path) -> None:
    from dsx3d.checkpoint.training.disk_format import foreign_files
    from dsx3d.checkpoint.training.universal import to_universal
    from dsx3d.cli import main

    config = MODELS["qwen3-tied-oddvocab"]()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    case = ParityCase(config, dp=2, tp=2, pp=1, zero_stage=3, steps=5, lr=3e-3)
    recipe = case_recipe(case)
    recipe.model = ModelSection(name_or_path=str(tmp_path / "hf"))
    batches = make_batches(case)
    saved = run_ranks(_save_rank, case.world_size, case, recipe, batches, tmp_path)[0]
    losses, eval_loss = saved["losses"], saved["eval"]

    # from_pretrained of the export (gathered from the partitions) gives the engine's held-out loss
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        hf = [
            exported(input_ids=ids, labels=ids).loss.item()
            for k in range(case.micro_batches)
            for d in range(case.dp)
            for ids in [micro_batch(case, batches[4], k, d)]
        ]
    assert abs(sum(hf) / len(hf) - eval_loss) < 1e-5, (hf, eval_loss)

    # every file the ZeRO-3 save wrote is one dsx3d knows as its own (a later --overwrite may remove it)
    assert foreign_files(tmp_path / "checkpoints") == []

    # the offline converter reads the ZeRO-3 partitions: bit for bit the collective export
    tag = tmp_path / "checkpoints" / "step-000002"
    assert main(["export", str(tag), str(tmp_path / "offline")]) == 0
    ta, tb = _tensors(tmp_path / "export"), _tensors(tmp_path / "offline")
    assert set(ta) == set(tb) and all(torch.equal(ta[n], tb[n]) for n in ta)

    # same layout: load_checkpoint continues with the uninterrupted run's losses
    got = run_ranks(_resume_rank, case.world_size, case, recipe, batches, tag, False)[0]
    assert got == pytest.approx(losses[2:], abs=1e-6, rel=0), (got, losses)

    # universal: the dp 2 x tp 2 tag resumes at dp 4 x tp 1 (same global batch), Adam state included
    if os.environ.get("DSX3D_SWEEP") != "1":
        return  # four more ranks: opt-in (DSX3D_SWEEP=1), CI stops here
    universal = to_universal(tag, tmp_path / "universal" / tag.name)
    wide = ParityCase(config, dp=4, tp=1, pp=1, zero_stage=3, micro_batches=1, steps=5, lr=3e-3)
    got = run_ranks(_resume_rank, wide.world_size, wide, case_recipe(wide), batches, universal, True)[0]
    assert got == pytest.approx(losses[2:], abs=1e-5, rel=0), (got, losses)


# -- dsx3d train: stop, resume --------------------------------------------------------------------------------


def _train(rank: int, recipe: Recipe, kwargs: dict[str, Any]) -> Any:
    from dsx3d.train import train

    return train(recipe, **kwargs)


@pytest.mark.slow
def test_train_zero2_tp2_resumes_exactly(tmp_path: Path) -> None:
    """Optimizer partitions (ZeRO-2 over dp, per TP rank), LR schedule, data position and RNG all resume."""

    def recipe(out: Path) -> Recipe:
        return recipe_from_dict(
            tiny_recipe_dict(
                parallel={"dp": 2, "tp": 2, "pp": 1},
                train={"micro_batch_size": 1, "steps": 4, "weight_decay": 0.01, "grad_clip": 0.5, "save_interval": 2},
                zero={"stage": 2},
                data={"cache_dir": str(tmp_path / "cache")},
                output_dir=str(out),
            )
        )

    from dsx3d.cli import main

    full = run_ranks(_train, 4, recipe(tmp_path / "full"), {}, timeout_s=300)[0]
    # the offline export reads the regular engine's per-TP-rank modules: the run's own export, bit for bit
    assert main(["export", str(tmp_path / "full" / "checkpoints"), str(tmp_path / "offline")]) == 0
    ta, tb = _tensors(tmp_path / "full" / "hf"), _tensors(tmp_path / "offline")
    assert set(ta) == set(tb) and all(torch.equal(ta[n], tb[n]) for n in ta)
    # the run kept its step-2 checkpoint (keep_checkpoints 2): resume a copy of the run from there
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "checkpoints" / "latest").write_text("step-000002")
    second = run_ranks(_train, 4, recipe(tmp_path / "resumed"), {"resume": True}, timeout_s=300)[0]
    assert (second.start_step, second.end_step) == (2, 4)
    assert second.losses == pytest.approx(full.losses[2:], abs=1e-6, rel=0), (second.losses, full.losses)
