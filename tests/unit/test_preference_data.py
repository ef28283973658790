"""data.format preference (dsx3d.data.preference): pairs encoded as TRL's DPOTrainer encodes them (plain and
conversational records), laid out as the Trainer face lays out TRL's collator output (both sides of a pair in one
micro-batch, prompts masked), the stream and held-out batches; and the checker's rules for train.objective dpo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from dsx3d.checks import check_recipe
from dsx3d.data.chat import DEFAULT_CHAT_TEMPLATE
from dsx3d.data.preference import (
    Pairs,
    PreferenceEval,
    PreferenceStream,
    encode_pair,
    encode_pairs,
    record_problem,
)
from dsx3d.data.tiny_chat import tiny_preference_pairs
from dsx3d.recipe.schema import recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]
PLAIN = {"prompt": ["The sky is", "Two and two make", "A cat says"], "chosen": [" blue.", " four.", " meow."],
         "rejected": [" made of cheese today.", " five.", " woof woof."]}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from dsx3d.data.tokenizer import train_bpe_tokenizer

    text = [" ".join(PLAIN[k]) for k in PLAIN] + [str(p) for p in tiny_preference_pairs(40)]
    tok = train_bpe_tokenizer(text * 4, vocab_size=400)
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


def _trl_encoded(tokenizer: Any, columns: dict[str, list[Any]], tmp: Path) -> Any:
    """TRL's own dataset preparation of `columns` (DPOTrainer._prepare_dataset on a stand-in trainer)."""
    import datasets
    import trl

    class Stand:
        _tokenizer = tokenizer
        _is_vision_dataset = False

    args = trl.DPOConfig(output_dir=str(tmp), max_length=None, report_to=[], bf16=False, gradient_checkpointing=False)
    return trl.DPOTrainer._prepare_dataset(Stand(), datasets.Dataset.from_dict(columns), tokenizer, args, "train")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["plain", "conversational"])
def test_pairs_are_encoded_as_trl_encodes_them(kind: str, tokenizer: Any, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    if kind == "plain":
        columns = PLAIN
    else:
        pairs = tiny_preference_pairs(12)
        columns = {k: [p[k] for p in pairs] for k in ("prompt", "chosen", "rejected")}
    trl_rows = _trl_encoded(tokenizer, columns, tmp_path)
    for i, row in enumerate(trl_rows):
        ours = encode_pair(tokenizer, DEFAULT_CHAT_TEMPLATE, columns["prompt"][i], columns["chosen"][i], columns["rejected"][i])
        assert ours == (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])


def test_micro_batches_equal_the_trainer_faces_layout_of_trls_collator(tokenizer: Any, tmp_path: Path) -> None:
    """TRL's collator output through the Trainer face's conversion equals the recipe face's micro-batch."""
    pytest.importorskip("trl")
    import datasets
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from dsx3d.objectives.preference_batches import preference_micro_batch

    seq_len = 32
    pairs = encode_pairs(datasets.Dataset.from_dict(PLAIN), _data(), tokenizer, None, seq_len)
    rows = _trl_encoded(tokenizer, PLAIN, tmp_path)
    collated = DataCollatorForPreference(pad_token_id=int(tokenizer.pad_token_id or 0))([dict(r) for r in rows])
    batch = {k: collated[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    ids, (labels, _norm, ref, tokens) = preference_micro_batch(batch, 4, seq_len)
    ours_ids, (ours_labels, _n, ours_ref, ours_tokens) = pairs.micro_batch(np.array([0, 1, 2, -1]))
    scored = labels != -100
    assert torch.equal(ours_labels, labels) and torch.equal(ours_tokens, tokens)
    assert torch.equal(ours_ids[scored], ids[scored]) and torch.equal(ours_ids[:, :1], ids[:, :1])
    assert ref.isnan().all() and ours_ref.isnan().all()
    assert tokens.tolist()[3] == -1 and tokens.tolist()[7] == -1  # the padding pair, on both sides


def _data(**kw: Any) -> Any:
    from dsx3d.recipe.schema import DataSection

    return DataSection(format="preference", **kw)


def test_prompts_that_fill_the_row_are_dropped_and_long_completions_cut(tokenizer: Any) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"prompt": ["x " * 30, "a"], "chosen": ["b", "c " * 40], "rejected": ["d", "e"]})
    pairs = encode_pairs(ds, _data(), tokenizer, None, 16)
    assert len(pairs.ids) == 1 and pairs.dropped == 1 and pairs.truncated == 1
    assert (pairs.labels[0, :, 0] == -100).all()  # the prompt is never scored


def test_record_problems_name_what_is_wrong() -> None:
    assert record_problem("p", "c", "r") is None
    msg = [{"role": "user", "content": "q"}]
    ans = [{"role": "assistant", "content": "a"}]
    assert record_problem(msg, ans, ans) is None
    assert "mixes text" in (record_problem("p", ans, ans) or "")
    assert "no assistant message" in (record_problem(msg, msg, ans) or "")


def test_stream_keeps_pairs_together_and_held_out_batches_pad_with_empty_pairs() -> None:
    n, s = 10, 8
    ids = np.arange(n * 2 * s, dtype=np.int32).reshape(n, 2, s)
    labels = ids.copy()
    labels[:, :, :3] = -100
    pairs = Pairs(ids, labels, np.full((n, 2), np.nan))
    stream = PreferenceStream(pairs, 2, 2, 2, 1, seed=3)
    x, (lab, _norm, _ref, tokens) = next(stream)
    assert x.shape == (4, s) and torch.equal(x[:2] // (2 * s), x[2:] // (2 * s))  # chosen row i and rejected row i: one pair
    assert tokens.tolist() == [5.0] * 4
    ranks = [PreferenceEval(pairs, 2, 2, 2, d) for d in (0, 1)]
    assert ranks[0].num_batches == 2  # 10 pairs in batches of 8: the second holds 2 and 6 padding pairs
    seen = [int(mb[0][i, 0]) // (2 * s) for ev in ranks for b in range(2) for mb in ev.batch(b) for i in range(2) if mb[1][3][i] >= 0]
    padded = [mb for ev in ranks for mb in ev.batch(1) if (mb[1][3] < 0).all()]
    assert sorted(seen) == list(range(10)) and len(padded) == 3


def _recipe(**train: Any) -> Any:
    base = yaml.safe_load((ROOT / "recipes" / "tiny-dpo.yaml").read_text())
    base["train"].update(train.pop("train", {}))
    for key, value in train.items():
        section, name = key.split("__")
        base.setdefault(section, {})[name] = value
    return recipe_from_dict(base)


@pytest.mark.parametrize(
    ("change", "key", "text"),
    [
        ({"data__format": "chat"}, "train.objective", "data.format preference"),
        ({"train": {"dpo": {"loss_type": ["sigmoid", "aot"]}}}, "train.dpo.loss_type", "sorts the log-ratios"),
        ({"train": {"dpo": {"loss_type": "nope"}}}, "train.dpo.loss_type", "not one of TRL's loss types"),
        ({"train": {"dpo": {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}}}, "train.dpo.loss_weights", "as many weights"),
        ({"train": {"dpo": {"reference": "adapters_off"}}}, "train.dpo.reference", "model.lora is not set"),
        ({"train": {"objective": "lm"}}, "train.objective", "data.format text"),
        ({"data__packing": True}, "data.packing", "whole pairs"),
    ],
)
def test_checker_refuses_with_key_value_and_fix(change: dict[str, Any], key: str, text: str) -> None:
    problems = [p for p in check_recipe(_recipe(**change), data=False) if p.key == key]
    assert problems and text in problems[0].reason and problems[0].fix, check_recipe(_recipe(**change), data=False)


def test_adapters_off_needs_fresh_adapters_and_zero3_is_refused() -> None:
    lora = {"r": 4, "init_lora_weights": False}
    problems = check_recipe(_recipe(model__lora=lora, train={"dpo": {"reference": "adapters_off"}}), data=False)
    assert any(p.key == "train.dpo.reference" and "initial policy" in p.reason for p in problems)
    problems = check_recipe(_recipe(zero__stage=3, parallel__pp=1, parallel__dp=2), data=False)
    assert any(p.key == "zero.stage" and "ZeRO-3" in p.reason for p in problems)


def test_shipped_recipe_is_accepted_and_auto_picks_the_reference() -> None:
    from dsx3d.engine.preference_run import reference_mode

    recipe = _recipe()
    assert not [p for p in check_recipe(recipe) if p.severity == "error"]
    auto = _recipe(train={"dpo": {"reference": "auto"}})
    assert reference_mode(auto, precomputed=False) == "copy" and reference_mode(auto, precomputed=True) == "precomputed"
    assert reference_mode(_recipe(model__lora={"r": 4}, train={"dpo": {"reference": "auto"}}), precomputed=False) == "adapters_off"


def test_precomputed_reference_needs_the_columns_before_launch(tmp_path: Path) -> None:
    import json

    problems = check_recipe(_recipe(train={"dpo": {"reference": "precomputed"}}))
    assert any(p.key == "train.dpo.reference" and "ref_chosen_logps" in p.reason for p in problems)
    rows = [{**p, "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0} for p in tiny_preference_pairs(20)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = _recipe(train={"dpo": {"reference": "precomputed"}}, data__source=str(tmp_path / "pairs.jsonl"))
    assert not [p for p in check_recipe(recipe) if p.severity == "error"]


def test_verify_objective_dpo_refuses_bf16_before_forking(capsys: pytest.CaptureFixture[str]) -> None:
    from dsx3d.cli import main

    assert main(["verify", "--objective", "dpo", "--dtype", "bf16", "--dp", "1", "--tp", "1", "--pp", "1"]) == 2
    assert "--dtype = 'bf16'" in capsys.readouterr().err
