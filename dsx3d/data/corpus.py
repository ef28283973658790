"""Where the training text comes from (`data.source`): a builtin corpus, local files, or a hub dataset.

Every source becomes a `datasets.Dataset` with one string column, "text", one row per document. A corpus
also has a fingerprint that changes whenever its text may have changed; the caches are keyed by it. For
builtin and local sources the fingerprint costs no reading, so a fully cached run never loads the text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from dsx3d.data.builtin_corpora import (  # noqa: F401
    BUILTIN_CHATS,
    BUILTIN_PREFERENCES,
    BUILTIN_PREFIX,
    BUILTINS,
    _split_sections,
    builtin_problem,
    python_docs_documents,
)
from dsx3d.data.cache import digest
from dsx3d.errors import UserError
from dsx3d.recipe.schema import DataSection

# Local file suffix -> the `datasets` packaged loader that reads it.
LOADERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Above this many bytes (or documents) a step may take seconds: show progress bars.
LARGE_BYTES = 50_000_000
LARGE_DOCUMENTS = 50_000


@dataclass(frozen=True)
class Corpus:
    """A resolved `data.source`: what it is, a fingerprint of its text, and how to load it."""

    source: str
    fingerprint: str
    load: Callable[[], datasets.Dataset]
    """Returns the documents as a Dataset with a single string column "text"."""
    large: bool
    """Big enough that loading and tokenizing take seconds (progress bars are worth showing)."""


def resolve_corpus(data: DataSection, cache_dir: Path | None = None) -> Corpus:
    """Turn `data.source` into a `Corpus`; raises `UserError` naming the key when it cannot be read.

    `cache_dir` is dsx3d's cache: `datasets` keeps its copies of local files under cache_dir/datasets.
    """
    source = data.source
    if source.startswith(BUILTIN_PREFIX):
        corpus = _builtin_corpus(data)
    elif is_saved_dataset(Path(source).expanduser()):
        corpus = _saved_corpus(data, Path(source).expanduser())
    elif (files := local_files(source, cache_dir)) is not None:
        corpus = _local_corpus(data, files, cache_dir)
    else:
        corpus = _hub_corpus(data)
    # Tokenizer training and tokenization both read the text: load it at most once.
    return dataclasses.replace(corpus, load=functools.cache(corpus.load))


_FORMAT_FIX = "set data.format to text, or point data.source at chat/instruction data (jsonl, parquet or a datasets folder)"

SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
"""A folder written by `datasets.Dataset.save_to_disk` holds these beside its arrow files."""
SAVED_DATASET_DICT = "dataset_dict.json"
"""... and one written by `DatasetDict.save_to_disk` holds this, with one such folder per split."""


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a `save_to_disk` folder (read with `datasets.load_from_disk`, not as data files)."""
    return path.is_dir() and (
        all((path / f).is_file() for f in SAVED_DATASET_FILES) or (path / SAVED_DATASET_DICT).is_file()
    )


def eval_data(data: DataSection) -> DataSection:
    """data.eval_source as a data section of its own (its split: data.eval_split, else data.split)."""
    assert data.eval_source is not None
    return data.model_copy(update={"source": data.eval_source, "split": data.eval_split or data.split})


def renamed_for_eval(err: UserError) -> UserError:
    """A problem found reading `eval_data(data)` names data.eval_source / data.eval_split."""
    keys = {"data.source": "data.eval_source", "data.split": "data.eval_split"}
    return UserError([dataclasses.replace(p, key=keys.get(p.key, p.key)) for p in err.problems])


def check_source(data: DataSection) -> None:
    """What `dsx3d check` can say about `data.source` before any process starts, without reading the text:
    a builtin's name, local files that exist, have a supported type and are readable. Raises `UserError`
    naming the key. Hub datasets are only resolved at training time (that needs the network)."""
    source = data.source
    if source.startswith(BUILTIN_PREFIX):
        problem = builtin_problem(data)
        if problem is not None:
            raise problem
        return
    if is_saved_dataset(Path(source).expanduser()):
        return
    files = local_files(source, None)
    unreadable = [str(f) for f in files or [] if not os.access(f, os.R_OK)]
    if unreadable:
        raise UserError.single(
            "data.source", source, f"cannot read {', '.join(unreadable[:3])}", "fix the files' permissions"
        )


# --- builtin -----------------------------------------------------------------------------------------


def _builtin_corpus(data: DataSection) -> Corpus:
    source = data.source
    problem = builtin_problem(data)
    if problem is not None:
        raise problem
    name = source[len(BUILTIN_PREFIX) :]
    if name in BUILTIN_PREFERENCES:
        pairs, keys = BUILTIN_PREFERENCES[name](), ("prompt", "chosen", "rejected")
        columns = {k: [p[k] for p in pairs] for k in keys}
        return Corpus(source, digest("builtin-preference-v1", source, pairs), lambda: datasets.Dataset.from_dict(columns), large=False)
    if name in BUILTIN_CHATS:
        chats = BUILTIN_CHATS[name]()
        fingerprint = digest("builtin-chat-v1", source, chats)
        return Corpus(source, fingerprint, lambda: datasets.Dataset.from_dict({"messages": chats}), large=False)
    documents = BUILTINS[name]()
    # Hash the text itself: pydoc_data differs between Python versions.
    h = hashlib.sha256()
    for doc in documents:
        h.update(doc.encode())
        h.update(b"\0")
    fingerprint = digest("builtin-v1", source, h.hexdigest())
    return Corpus(source, fingerprint, lambda: datasets.Dataset.from_dict({"text": documents}), large=False)


# --- local files -------------------------------------------------------------------------------------


def local_files(source: str, cache_dir: Path | None) -> list[Path] | None:
    """The files `source` names (a file, a directory searched recursively, or a glob); None if not local."""
    path = Path(source).expanduser()
    if path.is_dir():
        # Skip hidden files and our own cache (it holds .json metadata), wherever the user put it.
        skip = cache_dir.resolve() if cache_dir is not None else None
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix in LOADERS and not _hidden(p, path) and not _inside(p, skip)
        )
        if not files:
            raise UserError.single(
                "data.source",
                source,
                f"directory has no {'/'.join(LOADERS)} files",
                "point it at the data files",
            )
        return files
    if path.is_file():
        if path.suffix not in LOADERS:
            raise UserError.single(
                "data.source",
                source,
                f"unsupported file type {path.suffix!r}",
                f"use one of {', '.join(LOADERS)}",
            )
        return [path]
    if any(c in source for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).suffix in LOADERS)
        if not files:
            raise UserError.single(
                "data.source", source, "the pattern matches no data files", "fix the pattern"
            )
        return files
    if source.startswith(("/", "./", "../", "~")) or path.suffix in LOADERS:
        raise UserError.single(
            "data.source",
            source,
            "file or directory not found",
            "fix the path (relative paths start at the working directory)",
        )
    return None


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _inside(path: Path, directory: Path | None) -> bool:
    return directory is not None and path.resolve().is_relative_to(directory)


def _local_corpus(data: DataSection, files: list[Path], cache_dir: Path | None) -> Corpus:
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    fingerprint = digest("local-v1", stats, data.text_field, data.split) if not data.masked else digest(
        "local-v1", stats, source_columns(data), data.split
    )
    size = sum(s[1] for s in stats)

    def load() -> datasets.Dataset:
        with progress_bars(size >= LARGE_BYTES):
            parts = [_load_kind(data, kind, group, cache_dir) for kind, group in _by_loader(files).items()]
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)

    return Corpus(data.source, fingerprint, load, large=size >= LARGE_BYTES)


def _by_loader(files: list[Path]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for p in files:
        groups.setdefault(LOADERS[p.suffix], []).append(str(p))
    return dict(sorted(groups.items()))


def _load_kind(data: DataSection, kind: str, files: list[str], cache_dir: Path | None) -> datasets.Dataset:
    # A .txt file is one document: lines are not documents, and paragraphs of one text belong together.
    extra = {"sample_by": "document"} if kind == "text" else {}
    cache = str(cache_dir / "datasets") if cache_dir else None
    try:
        ds = datasets.load_dataset(kind, data_files=files, split=data.split, cache_dir=cache, **extra)
    except ValueError as err:
        if "split" in str(err).lower():
            raise UserError.single(
                "data.split",
                data.split,
                "local files form a single 'train' split",
                "use train or a slice such as train[:90%]",
            ) from None
        raise UserError.single(
            "data.source", data.source, f"cannot read {kind} files ({err})", "fix the files"
        ) from None
    except Exception as err:  # the packaged loaders raise many types (arrow, json, os)
        raise UserError.single(
            "data.source", data.source, f"cannot read {kind} files ({err})", "fix the files"
        ) from None
    if kind == "text" and data.masked:
        raise UserError.single(
            "data.source", data.source, f"plain-text files cannot hold {data.format} data", _FORMAT_FIX
        )
    return select_columns(ds, data, plain_text=kind == "text")


def source_columns(data: DataSection) -> dict[str, str]:
    """{recipe key: column} of what data.format reads from the source."""
    if data.format == "chat":
        return {"data.messages_field": data.messages_field}
    if data.format == "instruction":
        return {"data.prompt_field": data.prompt_field, "data.response_field": data.response_field}
    if data.format == "preference":
        return {"data.prompt_field": data.prompt_field, "data.chosen_field": data.chosen_field, "data.rejected_field": data.rejected_field}
    return {"data.text_field": data.text_field}


# What each recipe key's column is called once selected: the rest of dsx3d reads these names.
_INTERNAL = {
    "data.text_field": "text",
    "data.messages_field": "messages",
    "data.prompt_field": "prompt",
    "data.response_field": "response",
    "data.chosen_field": "chosen",
    "data.rejected_field": "rejected",
}
PRECOMPUTED_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # a preference source's reference sums (TRL's)


def select_columns(ds: datasets.Dataset, data: DataSection, plain_text: bool = False) -> datasets.Dataset:
    """Keep the columns data.format reads, renamed text / messages / prompt+response; raises `UserError`
    naming the key of a missing or mistyped column. `plain_text`: the packaged text loader's "text" column."""
    columns = {"data.text_field": "text"} if plain_text else source_columns(data)
    for key, field in columns.items():
        if field not in ds.column_names:
            raise UserError.single(
                key,
                field,
                f"{data.source} has no such column (columns: {', '.join(ds.column_names)})",
                f"set {key} to the column that holds the {_INTERNAL[key]}",
            )
        feature = ds.features[field]
        if data.format == "preference":
            continue  # text or message lists, checked per record (dsx3d.data.preference)
        if key != "data.messages_field" and (
            not isinstance(feature, datasets.Value) or feature.dtype not in ("string", "large_string")
        ):
            raise UserError.single(key, field, f"column is {feature}, not text", "name a string column")
        if key == "data.messages_field" and not isinstance(feature, (datasets.List, datasets.LargeList, list)):
            raise UserError.single(
                key, field, f"column is {feature}, not a list of messages", "name a column of [{role, content}, ...] lists"
            )
    keep = list(columns.values())
    if data.format == "preference" and all(c in ds.column_names for c in PRECOMPUTED_COLUMNS):
        keep += [c for c in PRECOMPUTED_COLUMNS if c not in keep]
    ds = ds.select_columns(keep)
    return ds.rename_columns({f: _INTERNAL[k] for k, f in columns.items() if f != _INTERNAL[k]})


# --- save_to_disk folders ----------------------------------------------------------------------------


def load_saved_split(data: DataSection, path: Path) -> datasets.Dataset:
    """The `data.split` of the save_to_disk folder `path` (memory-mapped: opening it reads the metadata, not
    the records); a folder holding one Dataset is taken whole."""
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:
        raise UserError.single(
            "data.source", data.source, f"cannot read this save_to_disk folder ({err})", "fix or re-save the dataset"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if data.split not in ds:
            raise UserError.single(
                "data.split", data.split, f"{data.source} has splits {', '.join(ds)}", "set data.split to one of them"
            )
        ds = ds[data.split]
    return ds


def _saved_corpus(data: DataSection, path: Path) -> Corpus:
    stats = [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()]
    fingerprint = digest("disk-v1", str(path.resolve()), stats, source_columns(data), data.format, data.split)
    size = sum(s[1] for s in stats)

    def load() -> datasets.Dataset:
        return select_columns(load_saved_split(data, path), data)

    return Corpus(data.source, fingerprint, load, large=size >= LARGE_BYTES)


# --- hub ---------------------------------------------------------------------------------------------


def _hub_corpus(data: DataSection) -> Corpus:
    try:
        ds = datasets.load_dataset(data.source, split=data.split)
    except Exception as err:  # offline, unknown name, unknown split, gated: all mean "cannot use it"
        raise UserError.single(
            "data.source",
            data.source,
            f"not a local path, and loading it as a hub dataset failed ({type(err).__name__}: {err})",
            "give a local .txt/.jsonl/.json/.parquet file or directory, or builtin:python-docs "
            "(hub datasets need network access; HF_HUB_OFFLINE=1 turns it off)",
        ) from None
    if not isinstance(ds, datasets.Dataset):
        raise UserError.single(
            "data.split", data.split, "did not select a single split", "name one split, e.g. train"
        )
    ds = select_columns(ds, data)
    fingerprint = digest("hub-v1", data.source, data.split, source_columns(data), ds._fingerprint)
    return Corpus(data.source, fingerprint, lambda: ds, large=ds.num_rows >= LARGE_DOCUMENTS)


# --- held-out part ------------------------------------------------------------------------------------


def split_held_out(corpus: Corpus, fraction: float, seed: int) -> tuple[Corpus, Corpus]:
    """(training part, held-out part) of `corpus`: round(fraction x rows) rows (at least 1) chosen by a
    permutation seeded with `seed`, so every rank and every run of the recipe holds out the same rows."""

    @functools.cache
    def parts() -> tuple[datasets.Dataset, datasets.Dataset]:
        ds = corpus.load()
        n = ds.num_rows
        held = np.random.default_rng(seed).permutation(n)[: max(1, round(n * fraction))]
        keep = np.ones(n, dtype=bool)
        keep[held] = False
        return ds.select(np.flatnonzero(keep)), ds.select(np.sort(held))

    def part(i: int, name: str) -> Corpus:
        fingerprint = digest("held-out-v1", corpus.fingerprint, fraction, seed, name)
        return Corpus(corpus.source, fingerprint, lambda: parts()[i], corpus.large)

    return part(0, "train"), part(1, "eval")


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """Show `datasets`' progress bars only for work that takes seconds; restore the previous setting."""
    was_enabled = datasets.is_progress_bar_enabled()
    if enabled != was_enabled:
        (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        if enabled != was_enabled:
            (datasets.enable_progress_bars if was_enabled else datasets.disable_progress_bars)()
