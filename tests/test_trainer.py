"""dsx3d.Trainer against plain single-process transformers.Trainer: per-step losses, gradient norms and learning
rates, evaluation before and after training, the exported checkpoint reloaded with from_pretrained, and resume
from a checkpoint. Forked gloo ranks (dsx3d.testing.harness), a tiny Llama, fp32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dsx3d.ds_config import build_ds_config
from dsx3d.errors import UserError
from dsx3d.models.families import tiny_config
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
            "train": {
                "micro_batch_size": MICRO,
                "gradient_accumulation_steps": ACCUM,
                "seq_len": SEQ,
                "dtype": "fp32",
                "grad_clip": 1.0,
            },
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
        include_num_input_tokens_seen="all",
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _steps(history: list[dict[str, Any]], key: str) -> list[float]:
    return [h[key] for h in history if key in h and "train_loss" not in h]


def _trainer_3d(rank: int, work: Path, ds_config: Path) -> dict[str, Any]:
    import dsx3d

    trainer = dsx3d.Trainer(
        model=_model(),
        args=_args(work / "run3d", deepspeed=str(ds_config)),
        train_dataset=_train_set(),
        eval_dataset=_eval_set(),
    )
    before = trainer.evaluate()["eval_loss"]
    metrics = trainer.train().metrics
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(work / "export"))
    figures = {
        "total_batch": trainer.get_total_train_batch_size(trainer.args),
        "samples": metrics["train_samples_per_second"] * metrics["train_runtime"],
        "tokens": trainer.state.num_input_tokens_seen,
        "flos": trainer.state.total_flos,
    }
    return {"history": trainer.state.log_history, "before": before, "after": after, "figures": figures}


def _trainer_ref(rank: int, work: Path, dp: int) -> dict[str, Any]:
    """Plain transformers.Trainer on one process: the same global batch as micro-batches of the same size."""
    from transformers import AutoModelForCausalLM, Trainer

    args = _args(work / "ref", gradient_accumulation_steps=ACCUM * dp)
    trainer = Trainer(model=_model(), args=args, train_dataset=_train_set(), eval_dataset=_eval_set())
    before = trainer.evaluate()["eval_loss"]
    metrics = trainer.train().metrics
    after = trainer.evaluate()["eval_loss"]
    figures = {
        "total_batch": trainer.get_total_train_batch_size(trainer.args),
        "samples": metrics["train_samples_per_second"] * metrics["train_runtime"],
        "tokens": trainer.state.num_input_tokens_seen,
        "flos": trainer.state.total_flos,
    }
    exported = AutoModelForCausalLM.from_pretrained(str(work / "export"))
    reloaded = Trainer(model=exported, args=_args(work / "reload"), eval_dataset=_eval_set()).evaluate()[
        "eval_loss"
    ]
    return {
        "history": trainer.state.log_history,
        "before": before,
        "after": after,
        "reloaded": reloaded,
        "figures": figures,
    }


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
    # figures count each DP shard once: total batch 2 x 2 x dp, 4 steps of it, 16 tokens a sample
    mine, theirs = ours[0]["figures"], ref["figures"]
    assert mine["total_batch"] == theirs["total_batch"] == MICRO * ACCUM * dp
    assert mine["tokens"] == theirs["tokens"] == STEPS * MICRO * ACCUM * dp * SEQ
    assert mine["flos"] == theirs["flos"]
    assert mine["samples"] == pytest.approx(theirs["samples"], rel=0.01)


def _resume_3d(rank: int, work: Path, ds_config: Path) -> dict[str, Any]:
    import dsx3d

    args = _args(work / "run", deepspeed=str(ds_config), save_strategy="steps", save_steps=2)
    full = dsx3d.Trainer(model=_model(), args=args, train_dataset=_train_set())
    full.train()
    resumed = dsx3d.Trainer(
        model=_model(), args=_args(work / "resumed", deepspeed=str(ds_config)), train_dataset=_train_set()
    )
    resumed.train(resume_from_checkpoint=str(work / "run" / "checkpoint-2"))
    return {
        "full": _steps(full.state.log_history, "loss"),
        "resumed": _steps(resumed.state.log_history, "loss"),
    }


def test_resume_continues_with_the_same_losses(tmp_path: Path) -> None:
    """A run resumed from its step-2 checkpoint (engine state, HF scheduler, data position) logs the same
    losses for steps 3 and 4 as the uninterrupted run."""
    ds_config = _write_ds_config(tmp_path / "ds.json", 2, 1, 2)
    r = run_ranks(_resume_3d, 4, tmp_path, ds_config)[0]
    assert len(r["full"]) == len(r["resumed"]) == STEPS, r
    assert max(abs(a - b) for a, b in zip(r["full"], r["resumed"], strict=True)) <= 1e-6, r
    assert (tmp_path / "run" / "checkpoint-2" / "config.json").is_file()  # checkpoints hold an HF export too


def _mismatched(rank: int, work: Path, ds_config: Path) -> list[str]:
    import dsx3d

    args = _args(
        work / "bad",
        deepspeed=str(ds_config),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        max_grad_norm=0.5,
    )
    try:
        dsx3d.Trainer(model=_model(), args=args, train_dataset=_train_set())
    except UserError as err:
        return [str(p) for p in err.problems]
    return []


def test_training_arguments_that_contradict_the_layout_are_refused(tmp_path: Path) -> None:
    """Without this check DeepSpeed would train with the layout's batch sizes while HF's Trainer computes its
    schedule, figures and data from its own, or fail at start-up ("train_batch_size is not equal to ...")."""
    ds_config = _write_ds_config(tmp_path / "ds.json", 2, 1, 2)
    problems = run_ranks(_mismatched, 1, tmp_path, ds_config)[0]
    text = "\n".join(problems)
    assert (
        "TrainingArguments.per_device_train_batch_size = 4" in text
        and "train_micro_batch_size_per_gpu = 2" in text
    ), text
    assert (
        "TrainingArguments.gradient_accumulation_steps = 3" in text
        and "gradient_accumulation_steps = 2" in text
    ), text
    assert "TrainingArguments.max_grad_norm = 0.5" in text and "gradient_clipping = 1.0" in text, text
    assert "WORLD_SIZE = 1" in text, text  # a 4-rank layout on 1 process


def test_a_dsx3d_config_json_turns_back_into_its_recipe(tmp_path: Path) -> None:
    """The Trainer rebuilds the recipe from the JSON's "dsx3d" section and top level; regenerating from it gives
    the same JSON, so the engine runs exactly the config the user passed."""
    from dsx3d.integrations.layout_source import recipe_from_ds_config

    original = json.loads(_write_ds_config(tmp_path / "ds.json", 2, 2, 2).read_text())
    recipe = recipe_from_ds_config(original, "ds.json", {"config": {"model_type": "llama"}})
    assert build_ds_config(recipe, 8) == original
    with pytest.raises(UserError, match="dsx3d"):
        recipe_from_ds_config(
            {k: v for k, v in original.items() if k != "dsx3d"},
            "plain.json",
            {"config": {"model_type": "llama"}},
        )


def _meta_model_from_recipe(rank: int, work: Path, recipe: Path) -> dict[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsx3d import Trainer  # before TrainingArguments: it teaches them recipe paths

    data = _eval_set()
    with torch.no_grad():  # the checkpoint's own loss on the whole eval set (equal lengths: a token mean)
        ids = torch.tensor(data["input_ids"])
        expected = AutoModelForCausalLM.from_pretrained(str(work / "ckpt"))(
            input_ids=ids, labels=ids
        ).loss.item()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(work / "ckpt")))
    args = _args(work / "meta", deepspeed=str(recipe), max_steps=1)  # a recipe path, not a JSON
    trainer = Trainer(model=model, args=args, train_dataset=_train_set(), eval_dataset=data)
    got = trainer.evaluate()["eval_loss"]
    trainer.train()
    return {"expected": expected, "got": got}


def test_meta_model_reads_its_checkpoint_and_a_recipe_path_is_a_layout(tmp_path: Path) -> None:
    """A meta-device model (nothing materialized) is filled from its local checkpoint, slice by slice; the layout
    comes from a recipe YAML passed as TrainingArguments.deepspeed; one process needs no launcher."""
    _model().save_pretrained(tmp_path / "ckpt")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tmp_path / "ckpt")},
                "parallel": {"dp": 1, "tp": 1, "pp": 1},
                "cluster": {"nodes": 1, "gpus_per_node": 1},
                "train": {
                    "micro_batch_size": MICRO,
                    "gradient_accumulation_steps": ACCUM,
                    "seq_len": SEQ,
                    "dtype": "fp32",
                },
                "zero": {"stage": 1},
            }
        )
    )
    r = run_ranks(_meta_model_from_recipe, 1, tmp_path, recipe)[0]
    assert abs(r["got"] - r["expected"]) <= TOL, r
