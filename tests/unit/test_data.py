"""Training data: corpus sources, the trained tokenizer, packing, and the per-rank micro-batch stream.

The stream tests guard what distributed training silently relies on: every layout with the same global
batch trains on the same samples at each step, and a resumed run sees exactly what it would have seen.
"""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from dsx3d.data import (
    EOS,
    MicroBatchStream,
    build_train_data,
    cut_blocks,
    prepare_data,
    python_docs_documents,
    resolve_corpus,
    tokenize_documents,
    train_bpe_tokenizer,
)
from dsx3d.errors import UserError
from dsx3d.recipe.schema import DataSection, recipe_from_dict


def make_recipe(model=None, **data):
    return recipe_from_dict(
        {
            "model": model or {"config": {"model_type": "llama"}},
            "train": {"seq_len": 64, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
            "data": data,
        }
    )


@pytest.fixture(scope="module")
def docs():
    return python_docs_documents()


@pytest.fixture(scope="module")
def tokenizer(docs):
    return train_bpe_tokenizer(docs, vocab_size=512)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dsx3d-cache")


# --- corpus ------------------------------------------------------------------------------------------


def test_builtin_corpus_is_real_english_text(docs):
    assert len(docs) > 100
    assert sum(map(len, docs)) > 300_000
    assert all(d.strip() == d and d for d in docs)
    assert any("assert" in d for d in docs)


def test_builtin_corpus_fingerprint_is_stable():
    a = resolve_corpus(DataSection(source="builtin:python-docs"))
    b = resolve_corpus(DataSection(source="builtin:python-docs"))
    assert a.fingerprint == b.fingerprint
    assert list(a.load()["text"]) == python_docs_documents()


def test_local_jsonl_text_and_directory_load(tmp_path):
    data = tmp_path / "data"
    hf_cache = data / "cache"  # the cache's own .json files inside a data directory are not data
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"body": f"doc {i}", "n": i}) + "\n" for i in range(3)))
    (data / "b.txt").write_text("line one\nline two\n\nsame document\n")
    jsonl = resolve_corpus(DataSection(source=str(data / "a.jsonl"), text_field="body"), hf_cache).load()
    assert jsonl.column_names == ["text"] and list(jsonl["text"]) == ["doc 0", "doc 1", "doc 2"]
    txt = resolve_corpus(DataSection(source=str(data / "b.txt")), hf_cache).load()
    assert list(txt["text"]) == ["line one\nline two\n\nsame document\n"]  # one .txt file = one document
    both = resolve_corpus(DataSection(source=str(data), text_field="body"), hf_cache).load()
    assert sorted(both["text"]) == sorted(list(jsonl["text"]) + list(txt["text"]))


def test_local_fingerprint_follows_the_file(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "one"}\n')
    before = resolve_corpus(DataSection(source=str(f))).fingerprint
    f.write_text('{"text": "one"}\n{"text": "two"}\n')
    assert resolve_corpus(DataSection(source=str(f))).fingerprint != before  # no load: fingerprint is cheap


def only_problem(err: pytest.ExceptionInfo[UserError]):
    assert len(err.value.problems) == 1
    return err.value.problems[0]


def test_missing_file_names_data_source(tmp_path):
    with pytest.raises(UserError) as err:
        resolve_corpus(DataSection(source=str(tmp_path / "nope.jsonl")), tmp_path / "hf")
    assert only_problem(err).key == "data.source" and "nope.jsonl" in str(err.value)


def test_missing_text_field_names_data_text_field(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError) as err:
        resolve_corpus(DataSection(source=str(tmp_path / "a.jsonl")), tmp_path / "hf").load()
    problem = only_problem(err)
    assert problem.key == "data.text_field" and problem.value == "text" and "body" in problem.reason


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(UserError) as err:
        resolve_corpus(DataSection(source="builtin:nope"))
    assert "builtin:python-docs" in only_problem(err).fix


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") != "1", reason="needs HF_HUB_OFFLINE=1 (scripts/env.sh)")
def test_unreachable_hub_dataset_names_data_source():
    with pytest.raises(UserError) as err:
        resolve_corpus(DataSection(source="someone/some-dataset"))
    assert only_problem(err).key == "data.source"


# --- tokenizer ---------------------------------------------------------------------------------------


def test_bpe_training_is_deterministic_and_round_trips(docs, tokenizer, tmp_path):
    again = train_bpe_tokenizer(docs, vocab_size=512)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert len(tokenizer) == 512 and tokenizer.eos_token == tokenizer.bos_token == EOS
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = 'The "assert" statement — ünïcode too\n'
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == text and loaded.eos_token_id == tokenizer.eos_token_id


def test_tokenizer_from_data_tokenizer_and_missing_one(tokenizer, cache_dir, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    prepared = prepare_data(make_recipe(tokenizer=str(tmp_path / "tok")), cache_dir)
    assert len(prepared.tokenizer) == 512
    with pytest.raises(UserError) as err:
        prepare_data(make_recipe(tokenizer=str(tmp_path / "missing")), cache_dir)
    assert only_problem(err).key == "data.tokenizer"


def test_tokenizer_from_model_directory(tokenizer, cache_dir, tmp_path):
    tokenizer.save_pretrained(tmp_path / "model")
    recipe = make_recipe(model={"name_or_path": str(tmp_path / "model")})
    assert len(prepare_data(recipe, cache_dir).tokenizer) == 512


# --- packing -----------------------------------------------------------------------------------------


def test_packing_puts_eos_after_each_document(tokenizer):
    texts = ["first document", "", "   ", "second one"]
    flat, num_documents = tokenize_documents(datasets.Dataset.from_dict({"text": texts}), tokenizer, "t")
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("first document", "second one")]
    eos = tokenizer.eos_token_id
    assert num_documents == 2
    assert flat.tolist() == enc[0] + [eos] + enc[1] + [eos]
    blocks = cut_blocks(flat, 3)
    assert blocks.shape == (len(flat) // 3, 3) and blocks.ravel().tolist() == flat[: blocks.size].tolist()


def test_prepare_builtin_then_cached(cache_dir):
    first = prepare_data(make_recipe(), cache_dir)
    second = prepare_data(make_recipe(), cache_dir)
    assert second.packed.cached and second.packed.path == first.packed.path
    assert np.array_equal(first.blocks, second.blocks) and first.blocks.shape[1] == 64
    assert first.packed.num_documents == len(python_docs_documents())
    assert (
        np.asarray(first.packed.tokens) == first.tokenizer.eos_token_id
    ).sum() == first.packed.num_documents
    recipe = make_recipe()
    recipe.train.seq_len = 32  # another seq_len reuses the token stream
    assert prepare_data(recipe, cache_dir).blocks.shape == (first.packed.tokens.size // 32, 32)


def test_build_train_data_yields_labels_equal_to_inputs(cache_dir):
    stream, tok = build_train_data(make_recipe(), dp=2, dp_rank=1, cache_dir=cache_dir)
    input_ids, labels = next(stream)
    assert input_ids.shape == (2, 64) and input_ids.dtype == torch.long
    assert torch.equal(input_ids, labels) and int(input_ids.max()) < len(tok)


def test_corpus_smaller_than_a_global_batch_is_a_user_error(cache_dir, tmp_path):
    (tmp_path / "tiny.jsonl").write_text('{"text": "just a few words"}\n')
    with pytest.raises(UserError) as err:
        build_train_data(
            make_recipe(source=str(tmp_path / "tiny.jsonl")), dp=1, dp_rank=0, cache_dir=cache_dir
        )
    assert only_problem(err).key == "data.source"


# --- stream ------------------------------------------------------------------------------------------

NUM_BLOCKS, SEQ = 37, 4
# Row i holds i*SEQ .. i*SEQ+3, so a sample's block index is its first token // SEQ.
BLOCKS = np.arange(NUM_BLOCKS * SEQ, dtype=np.uint16).reshape(NUM_BLOCKS, SEQ)


def ids(batch) -> list[int]:
    return (batch[0][:, 0] // SEQ).tolist()


def take(stream, n):
    return [next(stream) for _ in range(n)]


def test_stream_is_deterministic_and_seeded():
    a = take(MicroBatchStream(BLOCKS, 2, 3, 2, 1, seed=7), 30)
    b = take(MicroBatchStream(torch.from_numpy(BLOCKS.astype(np.int64)), 2, 3, 2, 1, seed=7), 30)
    c = take(MicroBatchStream(BLOCKS, 2, 3, 2, 1, seed=8), 30)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert [ids(x) for x in a] != [ids(x) for x in c]
    assert all(x[0].shape == (2, SEQ) and x[0].dtype == torch.long and torch.equal(*x) for x in a)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_ranks_together_read_the_global_batch_in_order(dp):
    micro, accum = 2, 2
    streams = [MicroBatchStream(BLOCKS, micro, accum, dp, d, seed=3) for d in range(dp)]
    for step in range(5):  # crosses epoch boundaries for dp >= 2
        per_rank = [take(s, accum) for s in streams]
        rows = [per_rank[d][k][0] for k in range(accum) for d in range(dp)]
        assert torch.equal(torch.cat(rows), streams[0].global_batch(step)[0])


def test_step_sample_set_does_not_depend_on_dp():
    """Equal global batch (8) at dp=1, 2, 4: each step trains on the same samples, so losses compare."""
    layouts = [(2, 4, 1), (2, 2, 2), (1, 2, 4)]  # (micro, accum, dp)
    sets = []
    for micro, accum, dp in layouts:
        streams = [MicroBatchStream(BLOCKS, micro, accum, dp, d, seed=11) for d in range(dp)]
        sets.append([sorted(i for s in streams for b in take(s, accum) for i in ids(b)) for _ in range(10)])
    assert sets[0] == sets[1] == sets[2]


def test_each_epoch_is_a_permutation_without_its_incomplete_tail():
    stream = MicroBatchStream(BLOCKS, 3, 2, 2, 0, seed=5)  # B = 12, 3 steps per epoch, 1 block dropped
    epochs = [
        sorted(i for t in range(e * 3, e * 3 + 3) for i in ids(stream.global_batch(t))) for e in range(3)
    ]
    assert all(len(set(e)) == 36 for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # the order (and the dropped block) reshuffles


@pytest.mark.parametrize("resume_at", [1, 5, 6, 13])  # 6 steps per epoch: 6 and 13 follow an epoch boundary
def test_resume_reproduces_the_uninterrupted_stream(resume_at):
    micro, accum, dp = 2, 3, 1
    full = take(MicroBatchStream(BLOCKS, micro, accum, dp, 0, seed=9), 20 * accum)
    from_step = take(MicroBatchStream(BLOCKS, micro, accum, dp, 0, seed=9, start_step=resume_at), 4 * accum)
    assert [ids(b) for b in from_step] == [ids(b) for b in full[resume_at * accum :][: 4 * accum]]

    running = MicroBatchStream(BLOCKS, micro, accum, dp, 0, seed=9)
    take(running, resume_at * accum + 1)  # stop mid-step
    resumed = MicroBatchStream(BLOCKS, micro, accum, dp, 0, seed=9)
    resumed.load_state_dict(json.loads(json.dumps(running.state_dict())))  # survives a JSON checkpoint
    assert [ids(b) for b in take(resumed, 5)] == [ids(b) for b in full[resume_at * accum + 1 :][:5]]


def test_resume_on_another_dp_keeps_the_step_samples():
    one = MicroBatchStream(BLOCKS, 2, 2, 2, 0, seed=1)
    take(one, 2 * 7)
    state = one.state_dict()
    other = [MicroBatchStream(BLOCKS, 1, 2, 4, d, seed=1) for d in range(4)]
    for s in other:
        s.load_state_dict(state)
    got = sorted(i for s in other for b in take(s, 2) for i in ids(b))
    assert got == sorted(ids(one.global_batch(7)))


def test_resume_refuses_a_different_seed_or_global_batch():
    state = MicroBatchStream(BLOCKS, 2, 2, 1, 0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        MicroBatchStream(BLOCKS, 2, 2, 1, 0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="samples_per_step"):
        MicroBatchStream(BLOCKS, 2, 3, 1, 0, seed=1).load_state_dict(state)
