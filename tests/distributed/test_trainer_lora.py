"""dsx3d.Trainer with a peft model (LoRA adapters, frozen base) at dp1 tp2 pp2 against plain
transformers.Trainer on the same peft model: per-step losses and gradient norms, and save_model() writes
peft's adapter format, which PeftModel.from_pretrained loads to the reference's trained logits. A model
with frozen parameters that is not a LoRA PeftModel is refused, naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.errors import UserError
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


def _peft_model() -> Any:
    from peft import LoraConfig, get_peft_model

    model = tiny_llama()
    torch.manual_seed(1)  # B nonzero, so a wrong TP reduction shows in the first step
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


def _logits(model: Any) -> torch.Tensor:
    ids = torch.tensor(eval_set()["input_ids"])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _ours(rank: int, work: Path, ds_config: Path) -> list[dict[str, Any]]:
    import dsx3d

    trainer = dsx3d.Trainer(model=_peft_model(), args=training_args(work / "ours", deepspeed=str(ds_config)), train_dataset=train_set())
    trainer.train()
    trainer.save_model(str(work / "adapter"))
    return trainer.state.log_history


def _reference(rank: int, work: Path) -> dict[str, Any]:
    from transformers import Trainer

    trainer = Trainer(model=_peft_model(), args=training_args(work / "ref"), train_dataset=train_set())
    trainer.train()
    return {"history": trainer.state.log_history, "logits": _logits(trainer.model)}


def test_trainer_trains_a_peft_model_like_transformers(tmp_path: Path) -> None:
    from peft import PeftModel

    ds_config = write_ds_config(tmp_path / "ds.json", 1, 2, 2)
    ours = run_ranks(_ours, 4, tmp_path, ds_config)[0]
    ref = run_ranks(_reference, 1, tmp_path)[0]
    for key, tol in (("loss", 1e-5), ("grad_norm", 1e-4)):
        a, b = step_values(ours, key), step_values(ref["history"], key)
        assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (key, a, b)
    loaded = PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert torch.allclose(_logits(loaded), ref["logits"], atol=1e-4, rtol=0)


def _frozen_plain(rank: int, work: Path, ds_config: Path) -> list[str]:
    import dsx3d

    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    try:
        dsx3d.Trainer(model=model, args=training_args(work / "x", deepspeed=str(ds_config)), train_dataset=train_set())
    except UserError as err:
        return [str(p) for p in err.problems]
    return []


def test_frozen_parameters_outside_peft_are_refused(tmp_path: Path) -> None:
    ds_config = write_ds_config(tmp_path / "ds.json", 1, 1, 1)
    text = "\n".join(run_ranks(_frozen_plain, 1, tmp_path, ds_config)[0])
    assert "requires_grad=False" in text and "model.embed_tokens.weight" in text and "get_peft_model" in text, text
