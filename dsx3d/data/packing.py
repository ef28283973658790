"""Packing: every document tokenized, followed by eos, concatenated, then cut into blocks of seq_len.

Blocks have a fixed length, so no padding and no attention mask: a pipeline exchanges shapes once and
needs every micro-batch to have the same shape. A block may span a document boundary; the eos token marks
it. The labels of a block are the block itself (the HF loss shifts them inside the model).

The flat token stream is cached as a .npy keyed by (corpus, tokenizer), not by seq_len: blocks are a view
of it, so changing train.seq_len costs nothing and a second run never tokenizes again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from dsx3d.data.cache import digest, save_json_atomic, save_npy_atomic
from dsx3d.data.corpus import Corpus, progress_bars
from dsx3d.data.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedTokens:
    """The whole corpus as one token stream (memory-mapped from the cache)."""

    tokens: np.ndarray
    """(num_tokens,) unsigned ints: doc 0, eos, doc 1, eos, ..."""
    num_documents: int
    path: Path
    cached: bool
    """True when read from the cache, False when tokenized by this call."""


def pack_corpus(corpus: Corpus, tokenizer: PreTrainedTokenizerBase, cache_dir: Path) -> PackedTokens:
    """The corpus's token stream, from the cache or tokenized now (and then cached)."""
    key = digest("tokens-v1", corpus.fingerprint, tokenizer_fingerprint(tokenizer))
    path = cache_dir / "tokens" / f"{key}.npy"
    meta_path = path.with_suffix(".json")
    cached = path.is_file() and meta_path.is_file()  # meta is written last: both present = complete
    if not cached:
        tokens, num_documents = tokenize_documents(corpus.load(), tokenizer, key, show_progress=corpus.large)
        save_npy_atomic(path, tokens)
        save_json_atomic(
            meta_path, {"documents": num_documents, "tokens": int(tokens.size), "source": corpus.source}
        )
    meta = json.loads(meta_path.read_text())
    return PackedTokens(np.load(path, mmap_mode="r"), int(meta["documents"]), path, cached)


def tokenize_documents(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    fingerprint: str,
    show_progress: bool = False,
) -> tuple[np.ndarray, int]:
    """Tokenize the "text" column (empty documents dropped), eos after each: (flat tokens, documents)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer needs an eos token to separate documents")

    def encode(batch: dict[str, list]) -> dict[str, list[list[int]]]:
        texts = [t for t in batch["text"] if t and not t.isspace()]
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
        return {"input_ids": [x + [eos] for x in ids]}

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    with progress_bars(show_progress):
        encoded = dataset.map(
            encode,
            batched=True,
            remove_columns=dataset.column_names,
            features=features,
            new_fingerprint=fingerprint,  # hashing the tokenizer by pickling it is slow and noisy
            desc="tokenizing",
        )
    chunks = [c.flatten().to_numpy(zero_copy_only=False) for c in encoded.data.column("input_ids").chunks]
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    flat = np.concatenate(chunks).astype(dtype) if chunks else np.zeros(0, dtype)
    return flat, encoded.num_rows


def cut_blocks(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(num_tokens,) -> (num_tokens // seq_len, seq_len), a view; the tail that fills no block is dropped."""
    num_blocks = tokens.size // seq_len
    return tokens[: num_blocks * seq_len].reshape(num_blocks, seq_len)
