"""Checkpoints and the HF export with virtual stages (parallel.virtual_stages: 2, interleaved-1f1b and zb-v), on 2
forked gloo ranks with tied embeddings (looped: chunk 0 of rank 0 and chunk 1 of rank 1 share the embedding; V-shaped:
both are rank 0's): before any step
the last stage's logits equal HF's; after a step the collective export equals the offline `dsx3d export` of the DeepSpeed checkpoint bit for bit (its layer files
are named by item, not by DeepSpeed's rank order), from_pretrained of the export gives the engine's own held-out
loss (eval_batch runs the chunks forward only), and a fresh engine loading the checkpoint takes the next step
with the uninterrupted run's loss."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline.interleaved import NAME
from dsx3d.pipeline.zb_v import NAME as ZB_V
from dsx3d.recipe.schema import ModelSection, Recipe, dump_recipe, recipe_from_dict
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase, case_recipe, make_batches, micro_batch

pytestmark = pytest.mark.usefixtures("warm")


def _micro(case: ParityCase, batch: torch.Tensor, dp_rank: int) -> Any:
    return iter([(ids, ids) for ids in (micro_batch(case, batch, k, dp_rank) for k in range(case.micro_batches))])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _rank(rank: int, case: ParityCase, recipe: Recipe, batches: torch.Tensor, tmp: Path) -> dict[str, Any]:
    from dsx3d.checkpoint.hf.export import export_hf
    from dsx3d.checkpoint.training.universal import universal_client_state
    from dsx3d.engine.builder import build_engine

    engine = build_engine(recipe)
    ids = batches[0][:2]
    _, logits = engine.ds_engine.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1)
    first = engine.train_step(_micro(case, batches[0], 0))
    # with what `dsx3d train` stores beside each tag (the gathered universal-checkpoint info)
    engine.ds_engine.save_checkpoint(str(tmp / "checkpoints"), tag="step-000001", client_state=universal_client_state(engine))
    if rank == 0:
        (tmp / "checkpoints" / "step-000001" / "dsx3d_recipe.yaml").write_text(dump_recipe(recipe))
    export_hf(engine, tmp / "export")
    held_out = engine.eval_loss(_micro(case, batches[2], 0))
    uninterrupted = engine.train_step(_micro(case, batches[1], 0))
    resumed = build_engine(recipe)
    resumed.ds_engine.load_checkpoint(str(tmp / "checkpoints"), tag="step-000001")
    again = resumed.train_step(_micro(case, batches[1], 0))
    return {"logits": logits, "eval": held_out, "next": uninterrupted, "resumed": again, "first": first}


@pytest.mark.parametrize("schedule", [NAME, ZB_V])
def test_checkpoint_export_and_resume_with_virtual_stages(tmp_path: Path, schedule: str) -> None:
    """Looped chunks (the loss on rank 1) and V-shaped ones (both ends, and the tied embedding, on rank 0)."""
    from dsx3d.cli import main

    config = tiny_config("qwen3", tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    case = ParityCase(config, dp=1, tp=1, pp=2, micro_batches=2, steps=3, lr=3e-3, schedule=schedule)
    recipe = case_recipe(case)
    assert recipe.parallel.virtual_stages == 2
    recipe.model = ModelSection(name_or_path=str(tmp_path / "hf"))
    batches = make_batches(case)
    results = run_ranks(_rank, case.world_size, case, recipe, batches, tmp_path)
    result = results[0 if schedule == ZB_V else 1]  # the rank of the last stage
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():  # before any step: the chunks' forward is the HF model's
        expected = reference(input_ids=batches[0][:2]).logits
    torch.testing.assert_close(result["logits"].float(), expected, atol=1e-5, rtol=0)
    assert result["resumed"] == pytest.approx(result["next"], abs=1e-6)

    ckpt = tmp_path / "checkpoints"
    (ckpt / "latest").write_text("step-000001")
    assert main(["export", str(ckpt), str(tmp_path / "offline")]) == 0
    exported, offline = _tensors(tmp_path / "export"), _tensors(tmp_path / "offline")
    assert set(exported) == set(offline) and all(torch.equal(exported[k], offline[k]) for k in exported)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["tie_word_embeddings"] is True

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        losses = [
            model(input_ids=ids, labels=ids).loss.item()
            for ids in (micro_batch(case, batches[2], k, 0) for k in range(case.micro_batches))
        ]
    assert sum(losses) / len(losses) == pytest.approx(result["eval"], abs=1e-5)


def _train_recipe(tmp_path: Path, out: Path, schedule: str) -> Recipe:
    from tests.helpers.recipes import tiny_recipe_dict

    return recipe_from_dict(
        tiny_recipe_dict(
            model={"config": {"num_hidden_layers": 4}},  # one per virtual stage
            parallel={"dp": 1, "tp": 1, "pp": 2, "schedule": schedule, "virtual_stages": 2},
            cluster={"nodes": 1, "gpus_per_node": 2},
            train={"steps": 4, "seq_len": 16, "micro_batch_size": 1, "gradient_accumulation_steps": 4,
                   "save_interval": 2, "keep_checkpoints": 2, "dtype": "fp32"},
            data={"cache_dir": str(tmp_path / "cache")},
            output_dir=str(out),
        )
    )


@pytest.mark.parametrize(
    "schedule", [pytest.param(NAME, marks=pytest.mark.skipif(not os.environ.get("DSX3D_INTERLEAVED_SWEEP"), reason="opt-in")), ZB_V]
)
def test_dsx3d_train_resume_accepts_its_own_checkpoint_with_virtual_stages(
    tmp_path: Path, schedule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dsx3d train --resume` previews the resume before any rank starts, comparing the tag's recorded stage bounds
    with the recipe's. Found by the fault campaign under zb-v: the preview computed the bounds of pp stages, not
    of the pp x v virtual stages as the engine places them on the ranks, and refused every resume of its own run."""
    from dsx3d.cli import main

    run = tmp_path / "run"
    recipe = _train_recipe(tmp_path, run, schedule)
    first = run_ranks(_train, 2, recipe, {"stop_at": 2}, timeout_s=300)[0]
    assert first.end_step == 2
    (tmp_path / "r.yaml").write_text(dump_recipe(recipe))
    assert main(["train", str(tmp_path / "r.yaml"), "--resume", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "continuing from" in err and "step-000002" in err and "error" not in err


@pytest.mark.skipif(not os.environ.get("DSX3D_INTERLEAVED_SWEEP"), reason="opt-in: DSX3D_INTERLEAVED_SWEEP=1")
@pytest.mark.parametrize("schedule", [NAME, ZB_V])
def test_dsx3d_train_with_virtual_stages_stops_and_resumes(tmp_path: Path, schedule: str) -> None:
    """`dsx3d.train.train` (what `dsx3d train` runs per rank) at pp 2 x v 2 with evaluation and checkpoints: a run
    stopped after 2 steps and resumed for 2 more gives the losses of an uninterrupted 4-step run."""

    def recipe(out: Path) -> Recipe:
        return _train_recipe(tmp_path, out, schedule)

    whole = run_ranks(_train, 2, recipe(tmp_path / "whole"), {}, timeout_s=300)[0]
    first = run_ranks(_train, 2, recipe(tmp_path / "resumed"), {"stop_at": 2}, timeout_s=300)[0]
    second = run_ranks(_train, 2, recipe(tmp_path / "resumed"), {"resume": True}, timeout_s=300)[0]
    assert (first.end_step, second.start_step, second.end_step) == (2, 2, 4)
    assert whole.losses[0] != whole.losses[-1]
    assert first.losses + second.losses == pytest.approx(whole.losses, abs=1e-6, rel=0)


def _train(rank: int, recipe: Recipe, kwargs: dict[str, Any]) -> Any:
    from dsx3d.train import train

    return train(recipe, **kwargs)
