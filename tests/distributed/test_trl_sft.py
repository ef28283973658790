"""TRL's SFTTrainer as a face of dsx3d.Trainer (`class PipelinedSFT(dsx3d.Trainer, trl.SFTTrainer)`): with a
model from `from_pretrained` (eval mode at load), packed at dp1 x tp2 x pp2 and cp2 x tp2 and unpacked (padded) at
dp1 x tp2 x pp2, per-step loss, gradient norm, mean_token_accuracy, entropy and num_tokens equal plain SFTTrainer
on one process; SFTConfig options that would be skipped and other
TRL trainers are refused by name, and SFTConfig's bf16 / gradient_checkpointing defaults meet the layout's
values like any TrainingArguments value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.errors import UserError
from dsx3d.verify.harness import run_ranks
from tests.helpers.trainer_helpers import ACCUM, MICRO, SEQ, VOCAB, step_values, tiny_llama, write_ds_config

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("warm")


def _dataset(samples: int = 64) -> Any:
    """Pre-tokenized examples of 2 to SEQ - 2 tokens (SFTTrainer packs them into rows of SEQ)."""
    import datasets

    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, VOCAB, (int(torch.randint(2, SEQ - 1, (1,), generator=g)),), generator=g).tolist() for _ in range(samples)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def _tokenizer() -> Any:
    from dsx3d.data.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300)  # pad = eos = 0


def _config(out: Path, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=4,
        learning_rate=2e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        packing=True,
        max_length=SEQ,
        bf16=False,
        gradient_checkpointing=False,
    )
    kwargs.update(overrides)
    return trl.SFTConfig(**kwargs)


def _run(rank: int, work: Path, ds_config: Path | None, packing: bool) -> list[dict[str, Any]]:
    """A model loaded as users load one (AutoModelForCausalLM.from_pretrained: in eval mode until the trainer's
    training step sets it training, and TRL picks its metric bucket by model.training)."""
    from transformers import AutoModelForCausalLM

    import dsx3d

    class PipelinedSFT(dsx3d.Trainer, trl.SFTTrainer):
        pass

    if ds_config is None:
        cls: Any = trl.SFTTrainer
        args = _config(work / "ref", packing=packing)
    else:
        cls, args = PipelinedSFT, _config(work / "3d", deepspeed=str(ds_config), packing=packing)
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    assert not model.training
    trainer = cls(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer())
    trainer.train()
    return trainer.state.log_history


# (dp, cp, tp, pp, packing); with cp each rank's slice of every packed row, its token statistics summed over the
# slices; unpacked: right-padded rows with an attention mask (num_tokens counts its ones)
@pytest.mark.parametrize(
    "case", [(1, 1, 2, 2, True), (1, 2, 2, 1, True), (1, 1, 2, 2, False)],
    ids=lambda t: "dp{}-cp{}-tp{}-pp{}-{}".format(*t[:4], "packed" if t[4] else "padded"),
)  # fmt: skip
def test_pipelined_sft_matches_plain_sft(tmp_path: Path, case: tuple[int, int, int, int, bool]) -> None:
    dp, cp, tp, pp, packing = case
    tiny_llama().save_pretrained(tmp_path / "model")
    ds_config = write_ds_config(tmp_path / "ds.json", dp, tp, pp, cp=cp)
    ours = run_ranks(_run, dp * cp * tp * pp, tmp_path, ds_config, packing)
    ref = run_ranks(_run, 1, tmp_path, None, packing)[0]
    for key, tol in (("loss", 1e-5), ("grad_norm", 1e-4), ("mean_token_accuracy", 1e-9), ("entropy", 1e-5), ("num_tokens", 0)):
        a, b = step_values(ours[0], key), step_values(ref, key)
        assert len(a) == len(b) == 4, (key, a, b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (key, a, b)
    assert all(step_values(r, "mean_token_accuracy") == step_values(ours[0], "mean_token_accuracy") for r in ours)


def _refused(rank: int, work: Path, ds_config: Path, base: str, overrides: dict[str, Any]) -> list[str]:
    import dsx3d

    bases: tuple[type, ...] = (dsx3d.Trainer, getattr(trl, base))

    cls = type("Combined", bases, {})
    try:
        cls(model=tiny_llama(), args=_config(work / "bad", deepspeed=str(ds_config), **overrides), train_dataset=_dataset(), processing_class=_tokenizer())
    except UserError as err:
        return [str(p) for p in err.problems]
    return []


@pytest.mark.parametrize(
    "base,overrides,names",
    [
        ("SFTTrainer", {"loss_type": "dft"}, ["SFTConfig.loss_type"]),
        ("SFTTrainer", {"activation_offloading": True}, ["SFTConfig.activation_offloading"]),
        ("RewardTrainer", {}, ["RewardTrainer"]),
        # SFTConfig's default counts as given: against a layout without activation checkpointing it disagrees
        # (bf16=True, its other default, meets the layout's dtype the same way; HF refuses it on a CPU first)
        ("SFTTrainer", {"gradient_checkpointing": True}, ["gradient_checkpointing"]),
    ],
)
def test_skipped_sft_options_and_other_trl_trainers_are_refused(tmp_path: Path, base, overrides, names) -> None:
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 1, 1)
    problems = run_ranks(_refused, 1, tmp_path, ds_config, base, overrides)[0]
    assert problems and all(any(n in p for p in problems) for n in names), problems
