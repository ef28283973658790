"""From a recipe to a rank's micro-batches: corpus -> tokenizer -> packed blocks -> stream.

`prepare_data` does the slow part once (train the tokenizer, tokenize the corpus) and caches it; call it
on one rank per cache directory before the others start. `build_train_data` then costs every rank a
fingerprint, a tokenizer load and a memory map. Both are safe to run concurrently: cache entries appear
atomically and identical inputs give identical entries.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from dsx3d.data.cache import default_cache_dir
from dsx3d.data.corpus import resolve_corpus
from dsx3d.data.packing import PackedTokens, cut_blocks, pack_corpus
from dsx3d.data.stream import MicroBatchStream
from dsx3d.data.tokenizer import resolve_tokenizer
from dsx3d.errors import UserError
from dsx3d.recipe import Recipe

log = logging.getLogger("dsx3d.data")


@dataclass(frozen=True)
class PreparedData:
    tokenizer: PreTrainedTokenizerBase
    packed: PackedTokens
    blocks: np.ndarray
    """(num_blocks, train.seq_len) token ids, a view of the cached token stream."""


def resolve_cache_dir(recipe: Recipe, cache_dir: str | Path | None = None) -> Path:
    """The argument, else data.cache_dir, else the default (`default_cache_dir`)."""
    chosen = cache_dir if cache_dir is not None else recipe.data.cache_dir
    return Path(chosen).expanduser() if chosen is not None else default_cache_dir()


def prepare_data(
    recipe: Recipe, cache_dir: str | Path | None = None, log_level: int = logging.INFO
) -> PreparedData:
    """Tokenizer and packed blocks for `recipe`, built now or read from the cache; logs one line on what it did."""
    start = time.perf_counter()
    cache = resolve_cache_dir(recipe, cache_dir)
    corpus = resolve_corpus(recipe.data, cache)
    tokenizer, tokenizer_how = resolve_tokenizer(recipe, corpus, cache)
    packed = pack_corpus(corpus, tokenizer, cache)
    seq_len = recipe.train.seq_len
    blocks = cut_blocks(packed.tokens, seq_len)
    log.log(
        log_level,
        "data %s: %d documents, %d tokens, %d blocks of %d (%s); tokenizer: %s; %.1f s",
        corpus.source,
        packed.num_documents,
        packed.tokens.size,
        len(blocks),
        seq_len,
        "tokens cached" if packed.cached else "tokenized",
        tokenizer_how,
        time.perf_counter() - start,
    )
    return PreparedData(tokenizer, packed, blocks)


def build_train_data(
    recipe: Recipe, dp: int, dp_rank: int, start_step: int = 0, cache_dir: str | Path | None = None
) -> tuple[MicroBatchStream, PreTrainedTokenizerBase]:
    """This DP rank's micro-batch stream from `start_step` on, and the tokenizer (to save with the model)."""
    prepared = prepare_data(recipe, cache_dir, log_level=logging.DEBUG)
    train = recipe.train
    global_batch = train.micro_batch_size * train.gradient_accumulation_steps * dp
    if len(prepared.blocks) < global_batch:
        raise UserError.single(
            "data.source",
            recipe.data.source,
            f"{len(prepared.blocks)} blocks of {train.seq_len} tokens do not fill one global batch of {global_batch} "
            "(train.micro_batch_size x train.gradient_accumulation_steps x dp)",
            "use a larger corpus, or lower train.seq_len, train.micro_batch_size or train.gradient_accumulation_steps",
        )
    stream = MicroBatchStream(
        prepared.blocks,
        train.micro_batch_size,
        train.gradient_accumulation_steps,
        dp,
        dp_rank,
        train.seed,
        start_step,
    )
    return stream, prepared.tokenizer
