"""Data formats and sources (chat, instruction, save_to_disk folders, local datasets with a split, held-out
data) and what the checker reads of the data before any process starts: each problem names the key, the
value and the fix, all at once, exit 2 without a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import yaml

from dsx3d.checks import check_recipe
from dsx3d.cli import main
from dsx3d.data.chat import IGNORE_INDEX
from dsx3d.data.prepare import build_rank_data, prepare_data
from dsx3d.data.tiny_chat import tiny_chat_conversations
from dsx3d.data.tokenizer import train_bpe_tokenizer
from dsx3d.recipe.schema import Recipe, recipe_from_dict
from tests.helpers.recipes import tiny_recipe_dict


def _recipe(tmp: Path, **data: Any) -> Recipe:
    sections = {"data": {"cache_dir": str(tmp / "cache"), **data}, "train": {"seq_len": 64}, "output_dir": str(tmp / "run")}
    return recipe_from_dict(tiny_recipe_dict(**sections))


def _errors(recipe: Recipe) -> dict[str, Any]:
    return {p.key: p for p in check_recipe(recipe) if p.severity == "error"}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", [{"conv": c} for c in tiny_chat_conversations(60)])


def test_chat_jsonl_with_a_field_name_and_held_out_fraction(tmp_path: Path, chats: Path) -> None:
    recipe = _recipe(tmp_path, source=str(chats), format="chat", messages_field="conv", eval_fraction=0.2)
    assert _errors(recipe) == {}
    prepared = prepare_data(recipe)
    assert prepared.packed is None and prepared.labels is not None and prepared.eval_rows is not None
    assert len(prepared.blocks) + len(prepared.eval_rows.input_ids) == 60
    assert (prepared.labels == IGNORE_INDEX).any() and (prepared.labels != IGNORE_INDEX).any()
    # every rank holds out the same rows; the stream carries the global normaliser
    data = build_rank_data(recipe, dp=1, dp_rank=0)
    ids, (labels, norm) = next(data.stream)
    assert ids.shape == labels.shape == (2, 64) and norm.dtype.is_floating_point
    assert data.eval_batches is not None and data.eval_batches.num_batches == 3  # 12 rows, batches of 4


def test_instruction_parquet_from_a_save_to_disk_dict_and_a_split_slice(tmp_path: Path) -> None:
    rows = {"q": [f"What is {i} plus 1?" for i in range(40)], "a": [f"{i + 1}." for i in range(40)]}
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict(rows)}).save_to_disk(folder)
    recipe = _recipe(tmp_path, source=str(folder), format="instruction", prompt_field="q", response_field="a",
                     eval_source=str(folder), eval_split="test")
    assert _errors(recipe) == {}
    prepared = prepare_data(recipe)
    assert len(prepared.blocks) == 40 and prepared.eval_rows is not None and len(prepared.eval_rows.input_ids) == 40
    wrong = _recipe(tmp_path, source=str(folder), format="instruction", prompt_field="q", response_field="a", split="validation")
    assert "data.split" in _errors(wrong)
    # a local parquet file read by `datasets` with a split slice
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "qa.parquet")
    sliced = _recipe(tmp_path, source=str(tmp_path / "qa.parquet"), format="instruction", prompt_field="q", response_field="a", split="train[:50%]")
    assert len(prepare_data(sliced).blocks) == 20


def test_a_save_to_disk_folder_is_a_dataset_not_its_json_metadata(tmp_path: Path) -> None:
    """It was read as data files (dataset_info.json, state.json), and the fix offered was data.text_field."""
    folder = tmp_path / "docs"
    datasets.Dataset.from_dict({"text": ["some words here. " * 40] * 30}).save_to_disk(folder)
    recipe = _recipe(tmp_path, source=str(folder))
    assert _errors(recipe) == {}
    assert prepare_data(recipe).packed.num_documents == 30  # type: ignore[union-attr]


def test_the_checker_names_every_data_problem_at_once(tmp_path: Path, chats: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    few = _write_jsonl(tmp_path / "few.jsonl", [{"messages": c} for c in tiny_chat_conversations(3)])
    cases = {
        "data.messages_field": _recipe(tmp_path, source=str(chats), format="chat"),  # the field is "conv"
        "data.text_field": _recipe(tmp_path, source=str(chats)),
        "data.source": _recipe(tmp_path, source=str(empty)),
        "data.eval_source": _recipe(tmp_path, source=str(chats), format="chat", messages_field="conv", eval_source=str(tmp_path / "nope.jsonl")),
    }
    for key, recipe in cases.items():
        problem = _errors(recipe).get(key)
        assert problem is not None and problem.reason and problem.fix, (key, _errors(recipe))
    too_few = _errors(_recipe(tmp_path, source=str(few), format="chat"))["data.source"]
    assert "fewer than one global batch of 4" in too_few.reason
    # one held-out example is enough (the last evaluation batch is padded with rows without loss) ...
    assert _errors(_recipe(tmp_path, source=str(chats), format="chat", messages_field="conv", eval_fraction=0.01)) == {}
    # ... but the training part must fill a global batch
    most = _errors(_recipe(tmp_path, source=str(chats), format="chat", messages_field="conv", eval_fraction=0.95))
    assert "3 once data.eval_fraction is held out" in most["data.source"].reason
    # several problems, one run, exit 2, no traceback
    path = tmp_path / "r.yaml"
    bad = tiny_recipe_dict(data={"source": str(chats), "format": "chat", "eval_source": str(empty)}, output_dir=str(tmp_path / "run"))
    path.write_text(yaml.safe_dump(bad))
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr()
    assert "data.messages_field" in out.out and "data.eval_source" in out.out and "Traceback" not in out.out + out.err


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix(tmp_path: Path, chats: Path) -> None:
    tok_dir = tmp_path / "tok"
    train_bpe_tokenizer(["hello world"] * 10, 300).save_pretrained(tok_dir)
    recipe = _recipe(tmp_path, source=str(chats), format="chat", messages_field="conv", tokenizer=str(tok_dir))
    problem = _errors(recipe)["data.chat_template"]
    assert "data.chat_template" in problem.fix
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {% generation %}{{ m['content'] }}{% endgeneration %}\n{% endfor %}")
    fixed = _recipe(tmp_path, source=str(chats), format="chat", messages_field="conv", tokenizer=str(tok_dir), chat_template=str(template))
    assert "data.chat_template" not in _errors(fixed)
    missing = _recipe(tmp_path, source=str(chats), format="chat", messages_field="conv", chat_template=str(tmp_path / "no.jinja"))
    assert "data.chat_template" in _errors(missing)


def test_formats_and_sources_that_cannot_go_together() -> None:
    from dsx3d.errors import UserError

    with pytest.raises(UserError, match="at most one of data.eval_source and data.eval_fraction"):
        recipe_from_dict(tiny_recipe_dict(data={"eval_source": "x.jsonl", "eval_fraction": 0.1}))
    assert "data.source" in _errors(recipe_from_dict(tiny_recipe_dict(data={"source": "builtin:tiny-chat"})))
    assert "data.source" in _errors(recipe_from_dict(tiny_recipe_dict(data={"format": "chat"})))


def test_held_out_text_keeps_its_tail_and_eval_batches_are_padded(tmp_path: Path) -> None:
    """Every held-out token is evaluated: the text tail that fills no block is one more block (padding
    labelled -100), and the last evaluation batch is filled with rows without loss."""
    from dsx3d.data.stream import EvalBatches, counted_tokens

    docs = [{"text": f"document {i}: the quick brown fox jumps{' high' * (i % 5)} over the lazy dog."} for i in range(120)]
    recipe = _recipe(tmp_path, source=str(_write_jsonl(tmp_path / "docs.jsonl", docs)), eval_fraction=0.1)
    rows = prepare_data(recipe).eval_rows
    assert rows is not None and rows.labels is not None
    real = rows.labels != IGNORE_INDEX
    assert real[:-1].all() and not real[-1].all()  # only the last block is padded
    batches = EvalBatches(rows.input_ids, rows.labels, 2, 2, 2, 1)
    assert batches.num_batches == -(-len(rows.input_ids) // 8)
    assert batches.counted == int(counted_tokens(rows.labels).sum())
    assert len(batches.batch(batches.num_batches - 1)) == 2


def test_evaluation_keys_without_held_out_data_are_a_warning(tmp_path: Path) -> None:
    recipe = recipe_from_dict(tiny_recipe_dict(train={"eval_interval": 10}, output_dir=str(tmp_path / "run")))
    warnings = [p for p in check_recipe(recipe) if p.key == "train.eval_interval"]
    assert len(warnings) == 1 and warnings[0].severity == "warning" and "data.eval_fraction" in warnings[0].fix


def test_a_hub_dataset_is_loaded_with_its_split_and_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network here: `datasets.load_dataset` stands in for the hub, returning local rows for the split."""
    from dsx3d.data import corpus
    from dsx3d.recipe.schema import DataSection

    calls: list[tuple[str, str]] = []

    def load_dataset(name: str, split: str) -> datasets.Dataset:
        calls.append((name, split))
        return datasets.Dataset.from_dict({"dialog": tiny_chat_conversations(5), "id": list(range(5))})

    monkeypatch.setattr(corpus.datasets, "load_dataset", load_dataset)
    data = DataSection(source="someone/chats", split="validation", format="chat", messages_field="dialog")
    ds = corpus.resolve_corpus(data).load()
    assert calls == [("someone/chats", "validation")] and ds.column_names == ["messages"] and ds.num_rows == 5
    from dsx3d.errors import UserError

    with pytest.raises(UserError, match="data.messages_field"):
        corpus.resolve_corpus(DataSection(source="someone/chats", format="chat"))


def test_a_masked_stream_resumes_exactly_and_its_norm_counts_the_global_batch() -> None:
    import numpy as np
    import torch

    from dsx3d.data.stream import MicroBatchStream, counted_tokens

    rng = np.random.default_rng(0)
    rows = rng.integers(0, 100, (40, 8))
    labels = np.where(rng.random((40, 8)) < 0.3, rows, IGNORE_INDEX)
    streams = [MicroBatchStream(rows, 2, 2, 2, d, seed=3, labels=labels) for d in range(2)]
    for step in range(6):
        n = int(counted_tokens(streams[0].global_batch(step)[1].numpy()).sum())
        for s in streams:
            for k in range(2):
                _, (_, norm) = s.micro_batch(step, k)
                assert float(norm) == max(n, 1) / 4
    first = MicroBatchStream(rows, 2, 2, 2, 1, seed=3, labels=labels)
    for _ in range(7):
        next(first)
    resumed = MicroBatchStream(rows, 2, 2, 2, 1, seed=3, labels=labels)
    resumed.load_state_dict(first.state_dict())
    for _ in range(5):
        (a, (la, na)), (b, (lb, nb)) = next(first), next(resumed)
        assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(na, nb)
