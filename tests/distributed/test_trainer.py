"""dsx3d.Trainer against plain single-process transformers.Trainer: per-step losses, gradient norms and learning
rates, evaluation before and after training, the exported checkpoint reloaded with from_pretrained, and resume
from a checkpoint. Forked gloo ranks (dsx3d.verify.harness), a tiny Llama, fp32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dsx3d.errors import UserError
from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import (
    ACCUM,
    HF_AUTO_CONFIG,
    MICRO,
    SEQ,
    eval_set,
    layout_recipe,
    step_values,
    tiny_llama,
    train_set,
    training_args,
    write_ds_config,
)

pytestmark = pytest.mark.usefixtures("warm")

STEPS = 4
TOL = 1e-5
_model, _train_set, _eval_set, _args, _steps, _write_ds_config = tiny_llama, train_set, eval_set, training_args, step_values, write_ds_config
EVAL_ROWS = 3  # per_device_eval_batch_size, not the training micro-batch: the pipeline must switch shapes


def token_accuracy(prediction: Any) -> dict[str, float]:
    """compute_metrics as run_clm writes it: predicted token t+1 at t against the labels, scored ones only."""
    preds, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    scored = labels != -100
    return {"accuracy": float((preds[scored] == labels[scored]).mean()), "scored": int(scored.sum())}


def _plain_eval_loss(model: Any) -> float:
    """`model`'s own HF forward over the eval set (equal lengths, every label scored: a token mean)."""
    ids = torch.tensor(_eval_set()["input_ids"])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def _trainer_3d(rank: int, work: Path, ds_config: Path) -> dict[str, Any]:
    import dsx3d
    from dsx3d.integrations.last_stage import argmax_logits

    trainer = dsx3d.Trainer(
        model=_model(),
        args=_args(work / "run3d", deepspeed=str(ds_config), per_device_eval_batch_size=EVAL_ROWS),
        train_dataset=_train_set(),
        eval_dataset=_eval_set(),
        compute_metrics=token_accuracy,
        preprocess_logits_for_metrics=argmax_logits,
    )
    before = trainer.evaluate()
    metrics = trainer.train().metrics
    after = trainer.evaluate()
    predicted = trainer.predict(_eval_set()).predictions
    trained = _plain_eval_loss(trainer.model)  # trainer.model holds the trained weights
    trainer.save_model(str(work / "export"))
    figures = {
        "total_batch": trainer.get_total_train_batch_size(trainer.args),
        "samples": metrics["train_samples_per_second"] * metrics["train_runtime"],
        "tokens": trainer.state.num_input_tokens_seen,
        "flos": trainer.state.total_flos,
    }
    return {"history": trainer.state.log_history, "before": before, "after": after, "figures": figures, "predicted": predicted, "trained": trained}


def _trainer_ref(rank: int, work: Path, dp: int) -> dict[str, Any]:
    """Plain transformers.Trainer on one process: the same global batch as micro-batches of the same size."""
    from transformers import AutoModelForCausalLM, Trainer

    from dsx3d.integrations.last_stage import argmax_logits

    args = _args(work / "ref", gradient_accumulation_steps=ACCUM * dp, per_device_eval_batch_size=EVAL_ROWS)
    trainer = Trainer(
        model=_model(),
        args=args,
        train_dataset=_train_set(),
        eval_dataset=_eval_set(),
        compute_metrics=token_accuracy,
        preprocess_logits_for_metrics=argmax_logits,
    )
    before = trainer.evaluate()
    metrics = trainer.train().metrics
    after = trainer.evaluate()
    predicted = trainer.predict(_eval_set()).predictions
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
        "predicted": predicted,
    }


# (dp, cp, tp, pp, ZeRO stage). dp2-tp2-pp1-zero3: no pipeline, DeepSpeed's regular engine with ZeRO-3 partitions
# over dp and TP shards; the cp ones: each rank's slice of every sequence, its predictions gathered over the CP group
@pytest.mark.parametrize(
    "layout",
    [(2, 1, 1, 2, 1), (1, 1, 2, 2, 1), (2, 1, 2, 1, 3), (1, 2, 1, 2, 1), (2, 2, 1, 1, 2)],
    ids=lambda t: f"dp{t[0]}-{f'cp{t[1]}-' if t[1] > 1 else ''}tp{t[2]}-pp{t[3]}-zero{t[4]}",
)
def test_trainer_matches_plain_transformers(tmp_path: Path, layout: tuple[int, int, int, int, int]) -> None:
    dp, cp, tp, pp, zero_stage = layout
    ds_config = _write_ds_config(tmp_path / "ds.json", dp, tp, pp, zero_stage, cp)
    ours = run_ranks(_trainer_3d, dp * cp * tp * pp, tmp_path, ds_config)
    ref = run_ranks(_trainer_ref, 1, tmp_path, dp)[0]
    for key, tol in (("loss", TOL), ("grad_norm", 1e-4), ("learning_rate", 1e-9)):
        a, b = _steps(ours[0]["history"], key), _steps(ref["history"], key)
        assert len(a) == len(b) == STEPS, (key, a, b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (key, a, b)
    assert _steps(ref["history"], "loss")[0] != _steps(ref["history"], "loss")[-1]  # it trained
    # every rank logs the same figures
    assert all(_steps(r["history"], "loss") == _steps(ours[0]["history"], "loss") for r in ours)
    for when in ("before", "after"):  # evaluation in batches of EVAL_ROWS, with compute_metrics on argmax ids
        a, b = ours[0][when], ref[when]
        assert abs(a["eval_loss"] - b["eval_loss"]) <= TOL, (when, a, b)
        assert a["eval_scored"] == b["eval_scored"] == 10 * (SEQ - 1) and a["eval_accuracy"] == b["eval_accuracy"], (when, a, b)
    keys = ("eval_loss", "eval_accuracy", "eval_scored")
    assert all([r["after"][k] for k in keys] == [ours[0]["after"][k] for k in keys] for r in ours)  # on every rank
    assert (ours[0]["predicted"] == ref["predicted"]).all() and ours[0]["predicted"].shape == (10, SEQ)
    assert abs(ref["reloaded"] - ours[0]["after"]["eval_loss"]) <= TOL, (ref["reloaded"], ours[0]["after"])
    assert all(abs(r["trained"] - ours[0]["after"]["eval_loss"]) <= TOL for r in ours), [r["trained"] for r in ours]
    # figures count each DP shard once: total batch 2 x 2 x dp, 4 steps of it, 16 tokens a sample
    mine, theirs = ours[0]["figures"], ref["figures"]
    assert mine["total_batch"] == theirs["total_batch"] == MICRO * ACCUM * dp
    assert mine["tokens"] == theirs["tokens"] == STEPS * MICRO * ACCUM * dp * SEQ
    assert mine["flos"] == theirs["flos"]
    assert mine["samples"] == pytest.approx(theirs["samples"], rel=0.01)


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
        and "ds.json: train_micro_batch_size_per_gpu = 2" in text
    ), text
    assert (
        "TrainingArguments.gradient_accumulation_steps = 3" in text
        and "ds.json: gradient_accumulation_steps = 2" in text
    ), text
    assert "TrainingArguments.max_grad_norm = 0.5" in text and "ds.json: gradient_clipping = 1.0" in text, text
    assert "WORLD_SIZE = 1" in text, text  # a 4-rank layout on 1 process


def _cp_refused(rank: int, work: Path, ds_config: Path) -> list[str]:
    import dsx3d

    try:
        dsx3d.Trainer(
            model=_model(), args=_args(work / "cp", deepspeed=str(ds_config)), train_dataset=_train_set(),
            compute_loss_func=z_loss_cross_entropy, preprocess_logits_for_metrics=confidence,
        )
    except UserError as err:
        return [str(p) for p in err.problems]
    return []


def test_functions_of_whole_sequences_are_refused_at_cp(tmp_path: Path) -> None:
    """At cp > 1 no rank holds a whole sequence's logits: HF's compute_loss_func and a preprocess_logits_for_metrics
    other than argmax_logits are refused by name, with every other problem (here the world size) at once."""
    ds_config = _write_ds_config(tmp_path / "ds.json", 1, 1, 1, 1, cp=2)
    text = "\n".join(run_ranks(_cp_refused, 1, tmp_path, ds_config)[0])
    assert "Trainer(compute_loss_func=...) = 'z_loss_cross_entropy'" in text, text
    assert "Trainer(preprocess_logits_for_metrics=...) = 'confidence'" in text and "argmax_logits" in text, text
    assert "WORLD_SIZE = 1" in text, text


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
    try:  # a meta model holds no weights, trained or not: saving it must not silently write an empty model
        trainer.model.save_pretrained(str(work / "meta-save"))
        refused = ""
    except UserError as err:
        refused = str(err)
    return {"expected": expected, "got": got, "refused": refused}


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
    assert "trainer.save_model" in r["refused"] and not (tmp_path / "meta-save").exists(), r


def z_loss_cross_entropy(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """A compute_loss_func as HF documents it: cross-entropy plus a z-loss on the full-vocabulary logits,
    summed over the scored tokens and divided by the step's token count."""
    logits = outputs.logits.float()[:, :-1].reshape(-1, outputs.logits.shape[-1])
    target = labels[:, 1:].reshape(-1)
    scored = target != -100
    ce = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    z = (torch.logsumexp(logits, dim=-1)[scored] ** 2).sum()
    return (ce + 1e-2 * z) / num_items_in_batch


def confidence(logits: Any, labels: Any) -> Any:
    """preprocess_logits_for_metrics that needs every column: the top softmax probability at each position."""
    return logits.float().softmax(dim=-1).max(dim=-1).values


def mean_confidence(prediction: Any) -> dict[str, float]:
    scored = prediction.label_ids[:, 1:] != -100
    return {"confidence": float(prediction.predictions[:, :-1][scored].mean())}


def _custom_loss_run(rank: int, work: Path, deepspeed: str | None) -> dict[str, Any]:
    """3D (deepspeed given) or plain HF on one process (None, the same global batch)."""
    import transformers

    import dsx3d

    # gradient_checkpointing: the recipe does not say, so it takes TrainingArguments' value
    args = _args(work / ("run3d" if deepspeed else "ref"), deepspeed=deepspeed, gradient_checkpointing=True)
    cls = dsx3d.Trainer if deepspeed else transformers.Trainer
    trainer = cls(
        model=_model(),
        args=args,
        train_dataset=_train_set(),
        eval_dataset=_eval_set(),
        compute_loss_func=z_loss_cross_entropy,
        compute_metrics=mean_confidence,
        preprocess_logits_for_metrics=confidence,
    )
    trainer.train()
    out = {"history": trainer.state.log_history, "eval": trainer.evaluate()}
    if deepspeed:
        out["checkpointing"] = trainer.engine3d.module.activation_checkpoint_interval
    return out


def test_compute_loss_func_and_full_logit_metrics_match_plain_transformers(tmp_path: Path) -> None:
    """At dp 1 x tp 2 x pp 2 the user's loss, on the last stage's logits gathered over the TP group, trains
    exactly as under plain HF, and a metric on full logits sees the same values. The layout comes from an
    HF-style DeepSpeed JSON full of "auto" that names its recipe; gradient_checkpointing=True turns on the
    recipe's activation checkpointing."""
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(layout_recipe(1, 2, 2)))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**HF_AUTO_CONFIG, "dsx3d": {"recipe": "r.yaml"}}))
    ours = run_ranks(_custom_loss_run, 4, tmp_path, str(ds))[0]
    ref = run_ranks(_custom_loss_run, 1, tmp_path, None)[0]
    assert ours["checkpointing"] == 1
    for key, tol in (("loss", TOL), ("grad_norm", 1e-4), ("learning_rate", 1e-9)):
        a, b = _steps(ours["history"], key), _steps(ref["history"], key)
        assert len(a) == len(b) == STEPS and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (key, a, b)
    assert abs(ours["eval"]["eval_confidence"] - ref["eval"]["eval_confidence"]) <= TOL, (ours["eval"], ref["eval"])


def test_transformers_leaves_zero3_partitioning_to_dsx3d(tmp_path: Path) -> None:
    """With a dsx3d layout at zero.stage 3 registered (TrainingArguments(deepspeed=...)), transformers would wrap
    every model built afterwards (the user's from_pretrained, dsx3d's meta skeletons) in deepspeed.zero.Init
    over the whole world; it once failed there on DeepSpeed's world-size batch check. Other configs keep
    transformers' own ZeRO-3 handling."""
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    from dsx3d import Trainer  # noqa: F401  (importing it installs the hook, as for recipe paths)

    ours = json.loads(_write_ds_config(tmp_path / "ds.json", 2, 2, 1, zero_stage=3).read_text())
    try:
        held = HfDeepSpeedConfig(ours)
        assert held.config["zero_optimization"]["stage"] == 3 and not is_deepspeed_zero3_enabled()
        held = HfDeepSpeedConfig({k: v for k, v in ours.items() if k != "dsx3d"})
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
