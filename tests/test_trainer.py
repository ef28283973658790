"""dsx3d.Trainer against plain single-process transformers.Trainer: per-step losses, gradient norms and learning
rates, evaluation before and after training, the exported checkpoint reloaded with from_pretrained, and resume
from a checkpoint. Forked gloo ranks (dsx3d.testing.harness), a tiny Llama, fp32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.ds_config import build_ds_config
from dsx3d.families import tiny_config
from dsx3d.recipe import recipe_from_dict
from dsx3d.testing.harness import run_ranks

pytestmark = pytest.mark.usefixtures("warm")

SEQ = 16
MICRO = 2  # micro-batch size
ACCUM = 2  # micro-batches per optimizer step and DP rank
STEPS = 4
TOL = 1e-5


def _config() -> Any:
    return tiny_config("llama", tie_word_embeddings=False)


def _model() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def _train_set() -> Any:
    """Fixed token ids; some labels ignored (-100), so micro-batches score different numbers of tokens and the
    loss must be weighted by tokens over the whole step, as HF's Trainer does."""
    import datasets

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (48, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.3] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _eval_set() -> Any:
    import datasets

    ids = torch.randint(0, 128, (10, SEQ), generator=torch.Generator().manual_seed(2))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _write_ds_config(path: Path, dp: int, tp: int, pp: int) -> Path:
    recipe = recipe_from_dict(
        {
            "model": {"config": {"model_type": "llama"}},
            "parallel": {"dp": dp, "tp": tp, "pp": pp},
            "cluster": {"nodes": 1, "gpus_per_node": dp * tp * pp},
            "train": {"micro_batch_size": MICRO, "gradient_accumulation_steps": ACCUM, "seq_len": SEQ, "dtype": "fp32", "grad_clip": 1.0},
            "zero": {"stage": 1},
        }
    )
    path.write_text(json.dumps(build_ds_config(recipe, dp * tp * pp)))
    return path


def _args(out: Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=2e-3,
        weight_decay=0.1,  # HF exempts biases and norms: the 3D optimizer must group the same way
        warmup_steps=1,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        per_device_eval_batch_size=MICRO,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _steps(history: list[dict[str, Any]], key: str) -> list[float]:
    return [h[key] for h in history if key in h and "train_runtime" not in h]


def _trainer_3d(rank: int, work: Path, ds_config: Path) -> dict[str, Any]:
    import dsx3d

    trainer = dsx3d.Trainer(
        model=_model(), args=_args(work / "run3d", deepspeed=str(ds_config)), train_dataset=_train_set(), eval_dataset=_eval_set()
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(work / "export"))
    return {"history": trainer.state.log_history, "before": before, "after": after}


def _trainer_ref(rank: int, work: Path, dp: int) -> dict[str, Any]:
    """Plain transformers.Trainer on one process: the same global batch as micro-batches of the same size."""
    from transformers import AutoModelForCausalLM, Trainer

    args = _args(work / "ref", gradient_accumulation_steps=ACCUM * dp)
    trainer = Trainer(model=_model(), args=args, train_dataset=_train_set(), eval_dataset=_eval_set())
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    exported = AutoModelForCausalLM.from_pretrained(str(work / "export"))
    reloaded = Trainer(model=exported, args=_args(work / "reload"), eval_dataset=_eval_set()).evaluate()["eval_loss"]
    return {"history": trainer.state.log_history, "before": before, "after": after, "reloaded": reloaded}


@pytest.mark.parametrize("layout", [(2, 1, 2), (1, 2, 2)], ids=lambda t: f"dp{t[0]}-tp{t[1]}-pp{t[2]}")
def test_trainer_matches_plain_transformers(tmp_path: Path, layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    ds_config = _write_ds_config(tmp_path / "ds.json", dp, tp, pp)
    ours = run_ranks(_trainer_3d, dp * tp * pp, tmp_path, ds_config)
    ref = run_ranks(_trainer_ref, 1, tmp_path, dp)[0]
    for key, tol in (("loss", TOL), ("grad_norm", 1e-4), ("learning_rate", 1e-9)):
        a, b = _steps(ours[0]["history"], key), _steps(ref["history"], key)
        assert len(a) == len(b) == STEPS, (key, a, b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (key, a, b)
    assert _steps(ref["history"], "loss")[0] != _steps(ref["history"], "loss")[-1]  # it trained
    # every rank logs the same figures
    assert all(_steps(r["history"], "loss") == _steps(ours[0]["history"], "loss") for r in ours)
    assert abs(ours[0]["before"] - ref["before"]) <= TOL, (ours[0]["before"], ref["before"])
    assert abs(ours[0]["after"] - ref["after"]) <= TOL, (ours[0]["after"], ref["after"])
    assert abs(ref["reloaded"] - ours[0]["after"]) <= TOL, (ref["reloaded"], ours[0]["after"])
