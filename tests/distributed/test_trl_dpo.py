"""TRL's DPOTrainer as a face of dsx3d.Trainer (`class PipelinedDPO(dsx3d.Trainer, trl.DPOTrainer)`): per-step loss,
gradient norm, rewards/* and logps/* equal plain DPOTrainer on one process (a from_pretrained tiny Llama, fp32),
with the frozen-copy reference and with a LoRA policy's base model as the reference, on generated pairs whose
prompts and completions differ in length; a reference computed by the policy itself is caught; DPOConfig options
dsx3d does not compute are refused by name. dp1 x tp2 x pp2 in CI; DSX3D_DPO_SWEEP=1 adds cp2 x pp2, dp2 x pp2 and
the tiled loss."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.errors import UserError
from dsx3d.models.known_families import tiny_config
from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import ACCUM, MICRO, SEQ, step_values, write_ds_config

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("warm")

STEPS = 3
KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")  # fmt: skip
"""Compared at every layout; pair means over equal micro-batches, so DP's per-slot gathering changes nothing."""


WORDS = ["a", "tiny", "corpus", "for", "tokenizer", "x", "yz", "q", "tin", "or"]


def pairs(samples: int = 2 * MICRO * ACCUM * STEPS, seed: int = 7) -> Any:
    """Plain-text pairs (TRL tokenizes them): prompts of 1-4 words, chosen and rejected completions of 1-4 words drawn
    apart, so lengths differ within a pair and across pairs."""
    import datasets

    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> str:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))

    rows = [(draw(1, 4), " " + draw(1, 4), " " + draw(1, 4)) for _ in range(samples)]
    return datasets.Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]})


def _tokenizer() -> Any:
    from dsx3d.data.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300)  # pad = eos = 0


def saved_model(work: Path) -> Path:
    path = work / "model"
    if not (path / "config.json").exists():
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(tiny_config("llama", tie_word_embeddings=False, vocab_size=320)).save_pretrained(path)
    return path


def _config(out: Path, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
        learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        max_length=SEQ, bf16=False, gradient_checkpointing=False, beta=0.5,
    )  # fmt: skip
    kwargs.update(overrides)
    return trl.DPOConfig(**kwargs)


def _model(work: Path, lora: bool) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_model(work), dtype=torch.float32)
    if lora:
        import peft

        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    return model


def _run(rank: int, work: Path, ds_config: Path | None, lora: bool, fault: str | None, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    import dsx3d

    class PipelinedDPO(dsx3d.Trainer, trl.DPOTrainer):
        pass

    if fault == "policy_reference":  # the reference pass forgets to swap in the reference weights
        from dsx3d.engine import reference

        reference.Reference.weights = lambda self: __import__("contextlib").nullcontext()  # type: ignore[method-assign]
    ref = ds_config is None
    cls: Any = trl.DPOTrainer if ref else PipelinedDPO
    args = _config(work / ("ref" if ref else "3d"), **({} if ref else {"deepspeed": str(ds_config)}), **overrides)
    trainer = cls(model=_model(work, lora), args=args, train_dataset=pairs(), processing_class=_tokenizer())
    trainer.train()
    return trainer.state.log_history


def _compare(ours: list[dict[str, Any]], ref: list[dict[str, Any]], keys: tuple[str, ...] = KEYS, rel: float = 1e-4) -> None:
    for key in keys:
        a, b = step_values(ours, key), step_values(ref, key)
        assert len(a) == len(b) == STEPS, (key, a, b)
        for x, y in zip(a, b, strict=True):
            assert abs(x - y) <= rel * max(abs(y), 1e-2), (key, a, b)


LAYOUTS = [(1, 1, 2, 2, 0)]  # (dp, cp, tp, pp, loss_tile_tokens)
if os.environ.get("DSX3D_DPO_SWEEP"):
    LAYOUTS += [(1, 2, 1, 2, 0), (2, 1, 1, 2, 0), (1, 1, 2, 2, 8), (1, 2, 2, 1, 8), (1, 1, 2, 1, 0)]


@pytest.mark.parametrize("lora", [False, True], ids=["frozen-copy", "lora"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "dp{}-cp{}-tp{}-pp{}-tile{}".format(*t))
def test_pipelined_dpo_matches_plain_dpo(tmp_path: Path, layout: tuple[int, int, int, int, int], lora: bool) -> None:
    dp, cp, tp, pp, tile = layout
    ds_config = write_ds_config(tmp_path / "ds.json", dp, tp, pp, cp=cp, **({"loss_tile_tokens": tile} if tile else {}))
    saved_model(tmp_path)
    ref = run_ranks(_run, 1, tmp_path, None, lora, None, {}, timeout_s=600)[0]
    # the single-process run trains with dp x GA micro-batches a step: TRL's mean of micro-batch means is then ours
    if dp > 1:
        ref = run_ranks(_run, 1, tmp_path, None, lora, None, {"gradient_accumulation_steps": ACCUM * dp}, timeout_s=600)[0]
    ours = run_ranks(_run, dp * cp * tp * pp, tmp_path, ds_config, lora, None, {}, timeout_s=600)
    _compare(ours[0], ref, KEYS if dp == 1 else KEYS[:8])
    assert abs(step_values(ref, "rewards/margins")[-1]) > 1e-3  # the policy moved: the comparison is not of zeros


@pytest.mark.skipif(not os.environ.get("DSX3D_DPO_SWEEP"), reason="DSX3D_DPO_SWEEP=1: TRL's other per-pair loss types")
@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": ["sigmoid", "ipo", "robust"], "loss_weights": [1.0, 0.5, 0.25], "label_smoothing": 0.1},
        {"loss_type": ["hinge", "exo_pair", "sigmoid_norm"], "label_smoothing": 0.2, "f_divergence_type": "js_divergence"},
        {"loss_type": ["nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop"]},
    ],
    ids=["sigmoid-ipo-robust", "hinge-exo-norm-js", "nca-bco-sppo-apo-discopop"],
)
def test_dpo_loss_types_match_plain_dpo(tmp_path: Path, overrides: dict[str, Any]) -> None:
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 2, 2)
    saved_model(tmp_path)
    ref = run_ranks(_run, 1, tmp_path, None, False, None, overrides, timeout_s=600)[0]
    ours = run_ranks(_run, 4, tmp_path, ds_config, False, None, overrides, timeout_s=600)
    _compare(ours[0], ref)


def test_reference_from_the_policy_is_caught(tmp_path: Path) -> None:
    """The fault: the reference pass runs the policy's current weights. Rewards are then 0 at step 1 and the
    loss log(2); from step 2 on they differ from TRL's."""
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 2, 2)
    saved_model(tmp_path)
    ref = run_ranks(_run, 1, tmp_path, None, False, None, {})[0]
    ours = run_ranks(_run, 4, tmp_path, ds_config, False, "policy_reference", {})[0]
    with pytest.raises(AssertionError):
        _compare(ours, ref, ("rewards/chosen", "loss"))


def _refused(rank: int, work: Path, ds_config: Path, overrides: dict[str, Any], kwargs: dict[str, Any]) -> list[str]:
    import dsx3d

    class PipelinedDPO(dsx3d.Trainer, trl.DPOTrainer):
        pass

    try:
        PipelinedDPO(model=_model(work, False), args=_config(work / "bad", deepspeed=str(ds_config), **overrides),
                     train_dataset=pairs(8), processing_class=_tokenizer(), **kwargs)  # fmt: skip
    except UserError as err:
        return [str(p) for p in err.problems]
    return []


def test_dpo_options_dsx3d_does_not_compute_are_refused(tmp_path: Path) -> None:
    """Every refusal at once, each named (one construction: the problems are collected before raising)."""
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 1, 1)
    saved_model(tmp_path)
    overrides = {"loss_type": ["sigmoid", "aot"], "ld_alpha": 0.5, "use_weighting": True, "precompute_ref_log_probs": True}
    problems = run_ranks(_refused, 1, tmp_path, ds_config, overrides, {"ref_model": "a model"})[0]
    names = ["DPOConfig.loss_type", "'aot'", "DPOConfig.ld_alpha", "DPOConfig.use_weighting", "DPOConfig.precompute_ref_log_probs",
             "DPOTrainer(ref_model=...)"]  # fmt: skip
    assert all(any(n in p for p in problems) for n in names), problems
    assert not any("sigmoid" in p.split(":")[0] for p in problems), problems


def _evaluate(rank: int, work: Path, ds_config: Path) -> list[str]:
    import dsx3d

    class PipelinedDPO(dsx3d.Trainer, trl.DPOTrainer):
        pass

    trainer = PipelinedDPO(model=_model(work, False), args=_config(work / "eval", deepspeed=str(ds_config)),
                           train_dataset=pairs(8), processing_class=_tokenizer())  # fmt: skip
    try:
        trainer.evaluate(eval_dataset=pairs(4, seed=9))
    except UserError as err:
        return [str(p) for p in err.problems]
    return []


def test_dpo_evaluation_is_refused_by_name(tmp_path: Path) -> None:
    """Not built yet: evaluate() says so by name, instead of failing on the preference batch's keys."""
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 1, 1)
    saved_model(tmp_path)
    problems = run_ranks(_evaluate, 1, tmp_path, ds_config)[0]
    assert problems and "evaluate()" in problems[0] and "dpo" in problems[0], problems
