"""Chat and instruction data as fixed-length rows: one example per row, padded (data.packing: several whole
examples per row, dsx3d.data.sft_packing).

Each example (a conversation, or a prompt and its response) is rendered and masked by dsx3d.data.chat,
cut to train.seq_len if longer (`truncated` in the log), and padded on the right to train.seq_len with the
pad token (the eos token when the tokenizer has no pad token); the padding's labels are -100. Why padding
and not packing: with right padding and causal attention no real token ever attends to a pad token, so
every example's logits are exactly those of the example alone, with no attention mask to build or send
between pipeline stages; packing several examples into a row would let later examples attend to earlier
ones unless a block-diagonal mask went with every micro-batch. An example cut before its first assistant
token carries no loss; it is kept (`without_loss` in the log, with a warning), so that the number of rows is
the number of records, which the checker counts before launch.

The rows are cached as two .npy arrays keyed by (corpus, tokenizer, template, format, seq_len).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from dsx3d.data.cache import digest, save_json_atomic, save_npy_atomic
from dsx3d.data.chat import IGNORE_INDEX, encode_conversation, example_messages, message_problem
from dsx3d.data.corpus import Corpus
from dsx3d.data.tokenizer import tokenizer_fingerprint
from dsx3d.errors import UserError
from dsx3d.recipe.schema import DataSection


@dataclass(frozen=True)
class Examples:
    input_ids: np.ndarray
    """(num_examples, seq_len) token ids, right-padded."""
    labels: np.ndarray
    """(num_examples, seq_len) int32: the id on an assistant token, -100 elsewhere (prompt, template, padding)."""
    truncated: int
    without_loss: int
    cached: bool
    lengths: np.ndarray | None = None
    """(num_examples,) int32: the tokens of each example before its padding (None: not recorded)."""


def encode_examples(
    dataset: datasets.Dataset, data: DataSection, tokenizer: PreTrainedTokenizerBase, template: str, seq_len: int
) -> tuple[np.ndarray, np.ndarray, int, int, np.ndarray]:
    """(input_ids, labels, truncated, without_loss, lengths) of every row of `dataset` (columns as
    dsx3d.data.corpus names them); lengths: each example's tokens before its padding."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows_ids, rows_labels, lengths, truncated, without_loss = [], [], [], 0, 0
    for index, row in enumerate(dataset):
        messages = example_messages(row, data)
        problem = message_problem(messages)
        if problem:
            key = data.messages_field if data.format == "chat" else f"{data.prompt_field}/{data.response_field}"
            raise UserError.single(
                "data.source", data.source, f"example {index} ({key}) {problem}", "fix or remove that example"
            )
        ids, labels = encode_conversation(tokenizer, messages, template)
        if len(ids) > seq_len:
            ids, labels, truncated = ids[:seq_len], labels[:seq_len], truncated + 1
        if all(t == IGNORE_INDEX for t in labels[1:]):  # position 0 is never predicted
            without_loss += 1
        fill = seq_len - len(ids)
        lengths.append(len(ids))
        rows_ids.append(ids + [pad] * fill)
        rows_labels.append(labels + [IGNORE_INDEX] * fill)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    input_ids = np.asarray(rows_ids, dtype=dtype).reshape(-1, seq_len)
    labels_out = np.asarray(rows_labels, dtype=np.int32).reshape(-1, seq_len)
    return input_ids, labels_out, truncated, without_loss, np.asarray(lengths, dtype=np.int32)


def cached_examples(
    corpus: Corpus,
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    seq_len: int,
    cache_dir: Path,
) -> Examples:
    """The corpus's rows, from the cache or encoded now (and then cached)."""
    key = digest("sft-v3", corpus.fingerprint, tokenizer_fingerprint(tokenizer), template, data.format, seq_len)
    base = cache_dir / "examples" / key
    ids_path, labels_path, meta_path = base.with_suffix(".ids.npy"), base.with_suffix(".labels.npy"), base.with_suffix(".json")
    lengths_path = base.with_suffix(".lengths.npy")
    cached = meta_path.is_file()  # written last: present = complete
    if not cached:
        input_ids, labels, truncated, without_loss, lengths = encode_examples(corpus.load(), data, tokenizer, template, seq_len)
        save_npy_atomic(ids_path, input_ids)
        save_npy_atomic(labels_path, labels)
        save_npy_atomic(lengths_path, lengths)
        save_json_atomic(meta_path, {"truncated": truncated, "without_loss": without_loss, "source": corpus.source})
    meta = json.loads(meta_path.read_text())
    return Examples(
        np.load(ids_path, mmap_mode="r"), np.load(labels_path, mmap_mode="r"), int(meta["truncated"]), int(meta["without_loss"]), cached,
        np.load(lengths_path),
    )
