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

from dsx3d.data.cache import digest
from dsx3d.errors import UserError
from dsx3d.recipe import DataSection

BUILTIN_PREFIX = "builtin:"
# Local file suffix -> the `datasets` packaged loader that reads it.
LOADERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
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
        corpus = _builtin_corpus(source)
    elif (files := _local_files(source, cache_dir)) is not None:
        corpus = _local_corpus(data, files, cache_dir)
    else:
        corpus = _hub_corpus(data)
    # Tokenizer training and tokenization both read the text: load it at most once.
    return dataclasses.replace(corpus, load=functools.cache(corpus.load))


def check_source(data: DataSection) -> None:
    """What `dsx3d check` can say about `data.source` before any process starts, without reading the text:
    a builtin's name, local files that exist, have a supported type and are readable. Raises `UserError`
    naming the key. Hub datasets are only resolved at training time (that needs the network)."""
    source = data.source
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        if name not in BUILTINS:
            known = ", ".join(BUILTIN_PREFIX + n for n in BUILTINS)
            raise UserError.single("data.source", source, "unknown builtin corpus", f"use one of: {known}")
        return
    files = _local_files(source, None)
    unreadable = [str(f) for f in files or [] if not os.access(f, os.R_OK)]
    if unreadable:
        raise UserError.single(
            "data.source", source, f"cannot read {', '.join(unreadable[:3])}", "fix the files' permissions"
        )


# --- builtin -----------------------------------------------------------------------------------------


def python_docs_documents() -> list[str]:
    """Python's language reference as shipped in `pydoc_data.topics` (the text behind `help("if")`).

    About half a megabyte of English prose and code in every CPython install, so a recipe trains with no
    download. Each topic is split at its section headings (a line underlined with = - * ~ or ^), giving
    a few hundred documents of a few KB each. Topics are taken in sorted order, so the list is stable.
    """
    from pydoc_data.topics import topics

    documents: list[str] = []
    for name in sorted(topics):
        documents.extend(_split_sections(topics[name]))
    return documents


def _split_sections(text: str) -> list[str]:
    lines = text.split("\n")
    starts = [0]
    for i in range(1, len(lines) - 1):
        title, rule = lines[i].rstrip(), lines[i + 1].rstrip()
        if title and len(rule) == len(title) and len(set(rule)) == 1 and rule[0] in "=-*~^":
            starts.append(i)
    bounds = zip(starts, starts[1:] + [len(lines)], strict=True)
    sections = ["\n".join(lines[a:b]).strip() for a, b in bounds]
    return [s for s in sections if s]


BUILTINS: dict[str, Callable[[], list[str]]] = {"python-docs": python_docs_documents}


def _builtin_corpus(source: str) -> Corpus:
    name = source[len(BUILTIN_PREFIX) :]
    if name not in BUILTINS:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTINS)
        raise UserError.single("data.source", source, "unknown builtin corpus", f"use one of: {known}")
    documents = BUILTINS[name]()
    # Hash the text itself: pydoc_data differs between Python versions.
    h = hashlib.sha256()
    for doc in documents:
        h.update(doc.encode())
        h.update(b"\0")
    fingerprint = digest("builtin-v1", source, h.hexdigest())
    return Corpus(source, fingerprint, lambda: datasets.Dataset.from_dict({"text": documents}), large=False)


# --- local files -------------------------------------------------------------------------------------


def _local_files(source: str, cache_dir: Path | None) -> list[Path] | None:
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
    fingerprint = digest("local-v1", stats, data.text_field, data.split)
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
    field = "text" if kind == "text" else data.text_field
    return _text_column(ds, data, field)


def _text_column(ds: datasets.Dataset, data: DataSection, field: str) -> datasets.Dataset:
    if field not in ds.column_names:
        raise UserError.single(
            "data.text_field",
            field,
            f"{data.source} has no such column (columns: {', '.join(ds.column_names)})",
            "set data.text_field to the column that holds the text",
        )
    if not isinstance(ds.features[field], datasets.Value) or ds.features[field].dtype not in (
        "string",
        "large_string",
    ):
        raise UserError.single(
            "data.text_field", field, f"column is {ds.features[field]}, not text", "name a string column"
        )
    ds = ds.select_columns([field])
    return ds.rename_column(field, "text") if field != "text" else ds


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
    ds = _text_column(ds, data, data.text_field)
    fingerprint = digest("hub-v1", data.source, data.split, data.text_field, ds._fingerprint)
    return Corpus(data.source, fingerprint, lambda: ds, large=ds.num_rows >= LARGE_DOCUMENTS)


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
