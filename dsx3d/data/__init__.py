"""Training data: a corpus (`data.source`), a tokenizer, fixed-length packed blocks (or padded chat and
instruction examples with their labels, or preference pairs: `preference.py`), per-rank micro-batches and held-out
evaluation batches.

The training entry point calls `prepare_data(recipe)` on one rank, then `build_rank_data(recipe, dp,
dp_rank, start_step)` (the stream, the held-out batches, the tokenizer) on every rank. Nothing here talks to other processes: every rank derives the same
data from (recipe, dp, dp_rank, step) alone.
"""

from dsx3d.data.cache import default_cache_dir
from dsx3d.data.corpus import Corpus, python_docs_documents, resolve_corpus
from dsx3d.data.packing import PackedTokens, cut_blocks, pack_corpus, tokenize_documents
from dsx3d.data.prepare import (
    PreparedData,
    RankData,
    build_rank_data,
    build_train_data,
    prepare_data,
    resolve_cache_dir,
)
from dsx3d.data.stream import EvalBatches, MicroBatchStream
from dsx3d.data.tokenizer import EOS, resolve_tokenizer, train_bpe_tokenizer

__all__ = [
    "EOS",
    "Corpus",
    "EvalBatches",
    "MicroBatchStream",
    "PackedTokens",
    "PreparedData",
    "RankData",
    "build_rank_data",
    "build_train_data",
    "cut_blocks",
    "default_cache_dir",
    "pack_corpus",
    "prepare_data",
    "python_docs_documents",
    "resolve_cache_dir",
    "resolve_corpus",
    "resolve_tokenizer",
    "tokenize_documents",
    "train_bpe_tokenizer",
]
