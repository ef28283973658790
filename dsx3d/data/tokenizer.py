"""The tokenizer: `data.tokenizer`, else the model's own, else a byte-level BPE trained on the corpus.

Training from scratch needs a tokenizer that exists on every machine without a download, so dsx3d trains
one: byte-level BPE (any text encodes, no unknown token) with a single special token, <|endoftext|>, used
as eos, bos and pad. Training is deterministic (same corpus and vocabulary size -> the same tokenizer.json,
byte for byte), and the result is cached under a key of (corpus fingerprint, vocabulary size), so every
rank and every later run loads the same files instead of training again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from dsx3d.checkpoint.hf.writer import TOKENIZER_FILES
from dsx3d.data.cache import atomic_dir, digest
from dsx3d.data.corpus import Corpus
from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
# Files whose presence in a model directory means it ships a tokenizer.


TRAINED = "byte-level BPE"
"""How `resolve_tokenizer` describes the tokenizer dsx3d trained (the start of its description)."""

BPE_MIN_TOKENS = 257
"""A byte-level BPE holds the 256 byte tokens and <|endoftext|> before any merge."""


def trained_tokenizer_bound(recipe: Recipe) -> int | None:
    """The most tokens of the BPE dsx3d trains for `recipe` (`resolve_tokenizer`'s last case), or None when
    the recipe names a tokenizer or the model directory ships one. Pure: reads no corpus."""
    if recipe.data.tokenizer is not None:
        return None
    model = recipe.model.name_or_path
    if model is not None:
        local = Path(model).expanduser()
        if not local.is_dir() or any((local / f).is_file() for f in TOKENIZER_FILES):
            return None
    return max(recipe.data.tokenizer_vocab_size, BPE_MIN_TOKENS)


def resolve_tokenizer(recipe: Recipe, corpus: Corpus, cache_dir: Path) -> tuple[PreTrainedTokenizerBase, str]:
    """The tokenizer for `recipe` and a few words on where it came from (for the log)."""
    trust = recipe.model.trust_remote_code
    if recipe.data.tokenizer is not None:
        return load_tokenizer(
            recipe.data.tokenizer, "data.tokenizer", trust
        ), f"data.tokenizer {recipe.data.tokenizer}"
    model = recipe.model.name_or_path
    if model is not None:
        local = Path(model).expanduser()
        if local.is_dir() and any((local / f).is_file() for f in TOKENIZER_FILES):
            return load_tokenizer(str(local), "model.name_or_path", trust), f"the model's ({model})"
        if not local.is_dir():
            try:  # a hub id: its tokenizer, when the hub (or its local cache) has one
                return AutoTokenizer.from_pretrained(model, trust_remote_code=trust), f"the model's ({model})"
            except Exception as err:
                log.debug("no tokenizer from %s: %s", model, err)
        # Token ids of a trained tokenizer mean nothing to pretrained embeddings: say so loudly.
        log.warning(
            "model.name_or_path %s has no tokenizer; training a byte-level BPE on the corpus, whose ids do not "
            "match the pretrained embeddings. Set data.tokenizer to the model's tokenizer.",
            model,
        )
    return cached_bpe_tokenizer(corpus, recipe.data.tokenizer_vocab_size, cache_dir)


def load_tokenizer(name: str, key: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained with a `UserError` naming `key` when it fails or has no eos token."""
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise UserError.single(
            key,
            name,
            f"cannot load a tokenizer ({type(err).__name__}: {err})",
            "give a directory with tokenizer files (or a hub id where the network allows), "
            "or leave data.tokenizer unset to train one on the corpus",
        ) from None
    if tok.eos_token_id is None:
        raise UserError.single(
            key, name, "the tokenizer has no eos token (needed between documents)", "use one that has"
        )
    return tok


def cached_bpe_tokenizer(
    corpus: Corpus, vocab_size: int, cache_dir: Path
) -> tuple[PreTrainedTokenizerBase, str]:
    """Load the BPE trained on `corpus`, training and caching it first if no run has yet."""
    path = cache_dir / "tokenizers" / f"bpe-{digest('bpe-v1', corpus.fingerprint, vocab_size)}"
    how = "cached"
    if not (path / "tokenizer.json").is_file():
        dataset = corpus.load()
        trained = train_bpe_tokenizer(
            _text_batches(dataset), vocab_size, length=dataset.num_rows, show_progress=corpus.large
        )
        with atomic_dir(path) as tmp:
            trained.save_pretrained(tmp)
        how = "trained"
    # Load from the files even right after training, so a first run and a cached run use identical objects.
    tok = AutoTokenizer.from_pretrained(str(path))
    return tok, f"{TRAINED}, {len(tok)} tokens, {how} at {path}"


def train_bpe_tokenizer(
    texts: Iterable[str] | Iterable[list[str]],
    vocab_size: int,
    length: int | None = None,
    show_progress: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` (strings, or batches of them) with <|endoftext|> as token 0.

    The vocabulary can come out smaller than `vocab_size` when the corpus runs out of pairs to merge.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, whatever the corpus holds
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A hash of what decides the token ids: the full tokenizer definition and the eos id."""
    backend = getattr(tok, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return digest(
        "tok-v1", type(tok).__name__, hashlib.sha256(content.encode()).hexdigest(), tok.eos_token_id
    )


def _text_batches(dataset, batch_size: int = 1000) -> Iterator[list[str]]:
    """The text of each row: a document, a conversation's contents, or a prompt and its response."""
    for batch in dataset.iter(batch_size=batch_size):
        if "text" in batch:
            yield [t for t in batch["text"] if t]
        elif "messages" in batch:
            yield ["\n".join(str(m.get("content", "")) for m in c if isinstance(m, dict)) for c in batch["messages"] if c]
        elif "chosen" in batch:
            yield ["\n".join(_texts(p) + _texts(c) + _texts(r)) for p, c, r in zip(batch["prompt"], batch["chosen"], batch["rejected"], strict=True)]
        else:
            yield [f"{p}\n{r}" for p, r in zip(batch["prompt"], batch["response"], strict=True)]


def _texts(value: object) -> list[str]:
    """A preference field's text: the string, or its messages' contents."""
    if isinstance(value, list):
        return [str(m.get("content", "")) for m in value if isinstance(m, dict)]
    return [str(value)] if value else []
