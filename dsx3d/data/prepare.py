"""From a recipe to a rank's micro-batches: corpus -> tokenizer -> packed blocks (text) or padded examples
(chat, instruction: dsx3d.data.sft) -> stream, and the held-out part -> evaluation batches.

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
from dsx3d.data.chat import IGNORE_INDEX, chat_template_for, missing_template_problem
from dsx3d.data.corpus import Corpus, eval_data, renamed_for_eval, resolve_corpus, split_held_out
from dsx3d.data.packing import PackedTokens, cut_blocks, pack_corpus
from dsx3d.data.preference import Pairs, PreferenceEval, PreferenceStream, encode_pairs
from dsx3d.data.sft import cached_examples
from dsx3d.data.sft_packing import pack_examples, packing_problems
from dsx3d.data.stream import EvalBatches, MicroBatchStream
from dsx3d.data.tokenizer import TRAINED, resolve_tokenizer
from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe

log = logging.getLogger("dsx3d.data")


@dataclass(frozen=True)
class Rows:
    """Training or held-out rows of train.seq_len tokens."""

    input_ids: np.ndarray
    """(num_rows, seq_len) token ids."""
    labels: np.ndarray | None
    """(num_rows, seq_len) labels with -100 where no loss (chat, instruction); None: the labels are the ids."""
    positions: np.ndarray | None = None
    """(num_rows, seq_len) position_ids of packed examples (data.packing), None otherwise."""
    lengths: np.ndarray | None = None
    """(num_rows,) tokens before each row's padding (chat, instruction), None for text blocks."""


@dataclass(frozen=True)
class PreparedData:
    tokenizer: PreTrainedTokenizerBase
    packed: PackedTokens | None
    """The packed token stream (data.format text; None for chat and instruction rows)."""
    blocks: np.ndarray
    """(num_blocks, train.seq_len) token ids: packed blocks (text) or padded examples."""
    labels: np.ndarray | None = None
    """(num_blocks, train.seq_len) labels of chat and instruction rows; None for text (labels = ids)."""
    eval_rows: Rows | None = None
    """The held-out rows (data.eval_source or data.eval_fraction), None without."""
    positions: np.ndarray | None = None
    """(num_blocks, train.seq_len) position_ids of packed examples (data.packing), None otherwise."""
    lengths: np.ndarray | None = None
    """(num_blocks,) tokens before each row's padding (chat, instruction), None for text blocks."""
    pairs: Pairs | None = None
    """data.format preference: the training pairs (blocks then holds their ids flattened)."""
    eval_pairs: Pairs | None = None


def resolve_cache_dir(recipe: Recipe, cache_dir: str | Path | None = None) -> Path:
    """The argument, else data.cache_dir, else the default (`default_cache_dir`)."""
    chosen = cache_dir if cache_dir is not None else recipe.data.cache_dir
    return Path(chosen).expanduser() if chosen is not None else default_cache_dir()


def prepare_data(
    recipe: Recipe, cache_dir: str | Path | None = None, log_level: int = logging.INFO
) -> PreparedData:
    """Tokenizer, training rows and held-out rows for `recipe`, built now or read from the cache; logs one
    line per part on what it did."""
    start = time.perf_counter()
    data = recipe.data
    problems = packing_problems(data)
    if problems:
        raise UserError(problems)
    cache = resolve_cache_dir(recipe, cache_dir)
    corpus = resolve_corpus(data, cache)
    tokenizer, tokenizer_how = resolve_tokenizer(recipe, corpus, cache)
    template = chat_template_for(data, tokenizer, trained=tokenizer_how.startswith(TRAINED))
    if data.masked:
        if template is None:
            raise missing_template_problem(data, tokenizer_how)
        tokenizer.chat_template = template  # saved with the tokenizer, so the exported model chats the same way
    train_corpus, eval_corpus = corpus, None
    if data.eval_fraction > 0:
        train_corpus, eval_corpus = split_held_out(corpus, data.eval_fraction, recipe.train.seed)
    elif data.eval_source is not None:
        try:
            eval_corpus = resolve_corpus(eval_data(data), cache)
        except UserError as err:
            raise renamed_for_eval(err) from None
    warn = logging.WARNING if log_level <= logging.INFO else logging.DEBUG  # said once, by the preparing rank
    if data.format == "preference":
        return _preference_data(recipe, tokenizer, template, train_corpus, eval_corpus, log_level, warn)
    packed, rows, what = _rows(recipe, train_corpus, tokenizer, template, cache, warn=warn, pack=data.packing)
    log.log(log_level, "data %s: %s; tokenizer: %s; %.1f s", corpus.source, what, tokenizer_how, time.perf_counter() - start)
    eval_rows = None
    if eval_corpus is not None:
        try:
            _, eval_rows, what = _rows(recipe, eval_corpus, tokenizer, template, cache, keep_tail=True, warn=warn)
        except UserError as err:
            raise renamed_for_eval(err) from None
        log.log(log_level, "held-out data %s: %s", data.eval_source or f"{data.eval_fraction:g} of data.source", what)
    return PreparedData(tokenizer, packed, rows.input_ids, rows.labels, eval_rows, rows.positions, rows.lengths)


def _preference_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, template: str | None, train_corpus: Corpus,
                     eval_corpus: Corpus | None, log_level: int, warn: int) -> PreparedData:  # fmt: skip
    seq_len, parts = recipe.train.seq_len, []
    for corpus in (train_corpus, eval_corpus):
        pairs = encode_pairs(corpus.load(), recipe.data, tokenizer, template, seq_len) if corpus is not None else None
        if pairs is not None:
            if pairs.dropped:
                log.log(warn, "%s: %d pairs dropped, their prompt fills train.seq_len %d", corpus.source, pairs.dropped, seq_len)  # type: ignore[union-attr]
            log.log(log_level, "preference data: %d pairs of %d tokens a side, %d cut to fit", len(pairs.ids), seq_len, pairs.truncated)
        parts.append(pairs)
    train, held = parts
    assert train is not None
    if len(train.ids) == 0:
        raise UserError.single("train.seq_len", seq_len, f"every prompt of {recipe.data.source} fills it", "raise train.seq_len")
    return PreparedData(tokenizer, None, train.ids.reshape(len(train.ids), -1), pairs=train, eval_pairs=held)


def _rows(
    recipe: Recipe,
    corpus: Corpus,
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    cache: Path,
    keep_tail: bool = False,
    warn: int = logging.WARNING,
    pack: bool = False,
) -> tuple[PackedTokens | None, Rows, str]:
    """`keep_tail` (held-out text): the tokens that fill no whole block become one more block, padded with
    labels -100, so that every held-out token is evaluated. `pack` (data.packing, training rows of chat and
    instruction data): whole examples packed into rows (dsx3d.data.sft_packing); held-out rows stay one
    example each (the evaluation loss is the same per-token mean either way)."""
    seq_len = recipe.train.seq_len
    if template is None:
        packed = pack_corpus(corpus, tokenizer, cache)
        blocks = cut_blocks(packed.tokens, seq_len)
        how = "tokens cached" if packed.cached else "tokenized"
        what = f"{packed.num_documents} documents, {packed.tokens.size} tokens, {len(blocks)} blocks of {seq_len} ({how})"
        tail = packed.tokens[blocks.size :]
        if not keep_tail or tail.size == 0:
            return packed, Rows(blocks, None), what
        padded = np.zeros((1, seq_len), dtype=blocks.dtype)
        padded[0, : tail.size] = tail
        labels = np.concatenate([np.asarray(blocks, dtype=np.int32), np.full((1, seq_len), IGNORE_INDEX, dtype=np.int32)])
        labels[-1, : tail.size] = tail
        return packed, Rows(np.concatenate([blocks, padded]), labels), what + f" + a last block of {tail.size}"
    ex = cached_examples(corpus, recipe.data, tokenizer, template, seq_len, cache)
    counted = int((np.asarray(ex.labels)[:, 1:] != IGNORE_INDEX).sum())
    what = (
        f"{len(ex.input_ids)} {recipe.data.format} examples padded to {seq_len} tokens, {counted} tokens with loss, "
        f"{ex.truncated} cut to fit ({'cached' if ex.cached else 'encoded'})"
    )
    if ex.without_loss:
        log.log(
            warn,
            "%s: %d of %d examples are cut by train.seq_len %d before their first assistant token and carry no loss; "
            "raise train.seq_len",
            corpus.source, ex.without_loss, len(ex.input_ids), seq_len,
        )
    if counted == 0:
        raise UserError.single(
            "train.seq_len", seq_len, f"no example of {corpus.source} has an assistant token within the first {seq_len} tokens",
            "raise train.seq_len",
        )
    if pack and ex.lengths is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rows = pack_examples(np.asarray(ex.input_ids), np.asarray(ex.labels), ex.lengths, int(pad))
        padding = 1 - float(rows.lengths.sum()) / rows.input_ids.size
        what += f"; packed into {len(rows.input_ids)} rows ({padding:.1%} padding)"
        return None, Rows(rows.input_ids, rows.labels, rows.positions, rows.lengths), what
    return None, Rows(ex.input_ids, ex.labels, None, ex.lengths), what


@dataclass(frozen=True)
class RankData:
    stream: MicroBatchStream
    eval_batches: EvalBatches | PreferenceEval | None
    tokenizer: PreTrainedTokenizerBase


def build_rank_data(
    recipe: Recipe, dp: int, dp_rank: int, start_step: int = 0, cache_dir: str | Path | None = None
) -> RankData:
    """This DP rank's micro-batch stream from `start_step` on, its held-out batches (None without held-out
    data), and the tokenizer (to save with the model)."""
    prepared = prepare_data(recipe, cache_dir, log_level=logging.DEBUG)
    train = recipe.train
    global_batch = train.micro_batch_size * train.gradient_accumulation_steps * dp
    what = "blocks" if prepared.labels is None else ("packed rows" if prepared.positions is not None else "examples")
    if len(prepared.blocks) < global_batch:
        raise UserError.single(
            "data.source",
            recipe.data.source,
            f"{len(prepared.blocks)} {what} of {train.seq_len} tokens do not fill one global batch of {global_batch} "
            "(train.micro_batch_size x train.gradient_accumulation_steps x dp)",
            "use a larger corpus, or lower train.seq_len, train.micro_batch_size or train.gradient_accumulation_steps",
        )
    if prepared.pairs is not None:
        evals = prepared.eval_pairs
        held = None
        if evals is not None and len(evals.ids):
            held = PreferenceEval(evals, train.micro_batch_size, train.gradient_accumulation_steps, dp, dp_rank, train.eval_batches)
        pairs = PreferenceStream(prepared.pairs, train.micro_batch_size, train.gradient_accumulation_steps, dp, dp_rank, train.seed, start_step)
        return RankData(pairs, held, prepared.tokenizer)
    stream = MicroBatchStream(
        prepared.blocks,
        train.micro_batch_size,
        train.gradient_accumulation_steps,
        dp,
        dp_rank,
        train.seed,
        start_step,
        labels=prepared.labels,
        positions=prepared.positions,
        lengths=prepared.lengths,
    )
    eval_batches = None
    if prepared.eval_rows is not None:
        rows = prepared.eval_rows
        if len(rows.input_ids) == 0:
            key, value = ("data.eval_source", recipe.data.eval_source) if recipe.data.eval_source else ("data.eval_fraction", recipe.data.eval_fraction)
            raise UserError.single(key, value, "the held-out data holds no tokens", "hold out more data")
        eval_batches = EvalBatches(
            rows.input_ids, rows.labels, train.micro_batch_size, train.gradient_accumulation_steps, dp, dp_rank, train.eval_batches
        )
    return RankData(stream, eval_batches, prepared.tokenizer)


def build_train_data(
    recipe: Recipe, dp: int, dp_rank: int, start_step: int = 0, cache_dir: str | Path | None = None
) -> tuple[MicroBatchStream, PreTrainedTokenizerBase]:
    """This DP rank's micro-batch stream from `start_step` on, and the tokenizer (to save with the model)."""
    data = build_rank_data(recipe, dp, dp_rank, start_step, cache_dir)
    return data.stream, data.tokenizer
