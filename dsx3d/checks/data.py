"""What the checker verifies about the data before any process starts (`dsx3d check`, `dsx3d train`).

Cheap looks only: which files a source names, their sizes, the first few records (streamed, so a large file
is not loaded), row counts where the format keeps them (jsonl lines, parquet metadata, save_to_disk
folders). From these: the source exists and has records; the field data.format reads is there (text,
messages or prompt/response) and the first records hold what that format needs; a chat template exists when
the format needs one; the training part can fill one global batch; the held-out data exists and has
records (any non-empty held-out part fills a batch: the last one is padded with rows without loss). A hub dataset
is not inspected (that needs the network): it is checked when the ranks load it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dsx3d.data.chat import message_problem, template_text
from dsx3d.data.corpus import (
    BUILTIN_CHATS,
    BUILTIN_PREFERENCES,
    BUILTIN_PREFIX,
    LOADERS,
    PRECOMPUTED_COLUMNS,
    check_source,
    eval_data,
    is_saved_dataset,
    load_saved_split,
    local_files,
    source_columns,
)
from dsx3d.data.sft_packing import packing_problems
from dsx3d.errors import Problem, UserError
from dsx3d.recipe.schema import DataSection, Recipe

PEEK_ROWS = 4
COUNT_LINES_BELOW = 64 << 20
"""jsonl files up to this many bytes have their lines counted; beyond, the row count is left unknown."""


@dataclass(frozen=True)
class SourceView:
    """The first records of a source, and what is known of its size without reading it all."""

    rows: list[dict[str, object]]
    num_rows: int | None
    num_bytes: int | None
    """An upper bound on its text's bytes (local files), None when unknown."""
    plain_text: bool = False
    """.txt files: the packaged text loader's single "text" column, whatever data.text_field says."""


def view_source(data: DataSection) -> SourceView | None:
    """A look at data.source; None when it cannot be looked at cheaply (a hub dataset, a builtin text corpus,
    which always fills a batch of the sizes dsx3d allows on CPU). Raises `UserError` naming the key."""
    check_source(data)
    source = data.source
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        if name in BUILTIN_CHATS:
            chats = BUILTIN_CHATS[name]()
            return SourceView([{data.messages_field: c} for c in chats[:PEEK_ROWS]], len(chats), None)
        if name in BUILTIN_PREFERENCES:
            pairs = BUILTIN_PREFERENCES[name]()
            fields = {"prompt": data.prompt_field, "chosen": data.chosen_field, "rejected": data.rejected_field}
            return SourceView([{fields[k]: v for k, v in p.items()} for p in pairs[:PEEK_ROWS]], len(pairs), None)
        return None
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        return _view_saved(data, path)
    files = local_files(source, None)
    if files is None:
        return None
    return _view_files(data, files)


def _view_saved(data: DataSection, path: Path) -> SourceView:
    ds = load_saved_split(data, path)
    rows = [dict(r) for r in ds.select(range(min(PEEK_ROWS, ds.num_rows)))]
    return SourceView(rows, ds.num_rows, None)


def _view_files(data: DataSection, files: list[Path]) -> SourceView:
    import datasets

    num_bytes = sum(f.stat().st_size for f in files)
    kinds = {LOADERS[f.suffix] for f in files}
    plain_text = kinds == {"text"}
    rows: list[dict[str, object]] = []
    for kind in sorted(kinds):
        group = [str(f) for f in files if LOADERS[f.suffix] == kind and f.stat().st_size > 0]
        if not group or len(rows) >= PEEK_ROWS:
            continue
        extra = {"sample_by": "document"} if kind == "text" else {}
        try:
            stream = datasets.load_dataset(kind, data_files=group, split="train", streaming=True, **extra)
            rows += [dict(r) for r in stream.take(PEEK_ROWS)]
        except Exception as err:  # the packaged loaders raise many types (arrow, json, os)
            raise UserError.single("data.source", data.source, f"cannot read {kind} files ({_short(err)})", "fix the files") from None
    return SourceView(rows, _count_rows(files), num_bytes, plain_text)


def _count_rows(files: list[Path]) -> int | None:
    """Rows, where cheap to know: a .txt file is one row; jsonl lines are counted; parquet metadata says how
    many rows; a .json array is not counted."""
    total = 0
    for f in files:
        kind = LOADERS[f.suffix]
        if kind == "text":
            total += 1 if f.stat().st_size > 0 else 0
        elif f.suffix == ".jsonl" and f.stat().st_size <= COUNT_LINES_BELOW:
            with f.open("rb") as fh:
                total += sum(1 for line in fh if line.strip())
        elif kind == "parquet":
            import pyarrow.parquet as pq

            try:
                total += pq.ParquetFile(f).metadata.num_rows
            except Exception:
                return None
        else:
            return None
    return total


def _short(err: Exception) -> str:
    return " ".join(str(err).split())[:200]


def _field_problems(data: DataSection, view: SourceView) -> Iterator[Problem]:
    columns = {"data.text_field": "text"} if view.plain_text else source_columns(data)
    if view.plain_text and data.masked:
        yield Problem("data.source", data.source, f"plain-text files cannot hold {data.format} data",
                      "set data.format to text, or point data.source at jsonl/parquet/save_to_disk data")
        return
    present = set(view.rows[0]) if view.rows else set()
    for key, field in columns.items():
        if field not in present:
            yield Problem(
                key, field, f"the first record of {data.source} has no such field (fields: {', '.join(sorted(present))})",
                f"set {key} to the field that holds the {key.split('.')[1].removesuffix('_field')}",
            )
            continue
        for i, row in enumerate(view.rows):
            value = row.get(field)
            why = None if data.format == "preference" and isinstance(value, str | list) else _value_problem(key, value)
            if why:
                yield Problem(key, field, f"record {i} of {data.source}: the field {why}",
                              "point it at a field of [{role, content}, ...] messages" if key == "data.messages_field" else "name a text field")
                break


def _value_problem(key: str, value: object) -> str | None:
    """Why one record's `value` of the field named by `key` cannot be used (None when it can). A text
    document may be missing (null rows are skipped); a prompt or response may not."""
    if key == "data.messages_field":
        return message_problem(value)
    if isinstance(value, str) or (value is None and key == "data.text_field"):
        return None
    return "is not a string"


def _size_problems(recipe: Recipe, data: DataSection, view: SourceView, global_batch: int) -> Iterator[Problem]:
    """The training part must fill one global batch (the held-out part is padded to whole batches)."""
    if global_batch <= 0:
        return
    fix = "use more data, or lower train.micro_batch_size, train.gradient_accumulation_steps or dp"
    fraction = recipe.data.eval_fraction
    if data.masked and view.num_rows is not None:
        held = max(1, round(view.num_rows * fraction)) if fraction > 0 else 0
        rows = view.num_rows - held
        if rows < global_batch:
            part = f", {rows} once data.eval_fraction is held out" if held else ""
            yield Problem("data.source", data.source,
                          f"{view.num_rows} examples{part}: fewer than one global batch of {global_batch} "
                          "(train.micro_batch_size x train.gradient_accumulation_steps x dp)", fix)
    elif not data.masked and view.num_bytes is not None:
        # A token covers at least one byte, plus one eos per document: an upper bound on the tokens.
        bound = view.num_bytes + (view.num_rows or 0)
        need = global_batch * recipe.train.seq_len
        if bound < need:
            yield Problem("data.source", data.source, f"at most {bound} tokens ({view.num_bytes} bytes), fewer than one "
                          f"global batch needs ({global_batch} x train.seq_len {recipe.train.seq_len} = {need})", fix + ", or train.seq_len")


def _template_problems(recipe: Recipe) -> Iterator[Problem]:
    data = recipe.data
    if not data.masked:
        return
    try:
        if template_text(data) is not None:
            return
    except UserError as err:
        yield from err.problems
        return
    from dsx3d.data.tokenizer import trained_tokenizer_bound

    if trained_tokenizer_bound(recipe) is not None:  # dsx3d trains the tokenizer and gives it its default template
        return
    name = data.tokenizer or recipe.model.name_or_path
    key = "data.tokenizer" if data.tokenizer else "model.name_or_path"
    if name is None or not Path(name).expanduser().is_dir():
        return  # a hub tokenizer: looked at when the ranks load it
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(Path(name).expanduser()), trust_remote_code=recipe.model.trust_remote_code)
    except Exception as err:
        yield Problem(key, name, f"cannot load a tokenizer ({_short(err)})", "give a directory with tokenizer files")
        return
    if not getattr(tok, "chat_template", None):
        yield Problem(
            "data.chat_template", None, f"data.format {data.format} needs a chat template and the tokenizer of {key} {name} has none",
            "set data.chat_template to a Jinja template (or a file holding one), with {% generation %} blocks around the "
            "assistant's content, or use a tokenizer that ships one",
        )


def _renamed(problems: Iterator[Problem]) -> Iterator[Problem]:
    keys = {"data.source": "data.eval_source", "data.split": "data.eval_split"}
    for p in problems:
        yield dataclasses.replace(p, key=keys.get(p.key, p.key))


def _source_problems(recipe: Recipe, data: DataSection, global_batch: int) -> Iterator[Problem]:
    try:
        view = view_source(data)
    except UserError as err:
        yield from err.problems
        return
    if view is None:
        return
    if view.num_rows == 0 or not view.rows:
        yield Problem("data.source", data.source, "holds no records", "point it at data with records")
        return
    fields = list(_field_problems(data, view))
    yield from fields
    if data.format == "preference" and recipe.train.dpo.reference == "precomputed" and data.source == recipe.data.source:
        missing = [c for c in PRECOMPUTED_COLUMNS if not view.rows or any(c not in row for row in view.rows)]
        if missing:
            yield Problem("train.dpo.reference", "precomputed", f"the records of {data.source} have no {' / '.join(missing)}",
                          "add TRL's ref_chosen_logps and ref_rejected_logps to every record, or set train.dpo.reference: auto")  # fmt: skip
    if not fields:
        yield from _size_problems(recipe, data, view, global_batch)


def data_problems(recipe: Recipe, dp: int) -> list[Problem]:
    """Every problem the checker can see in the recipe's data (module docstring); dp 0 when unresolved."""
    data = recipe.data
    train = recipe.train
    global_batch = train.micro_batch_size * train.gradient_accumulation_steps * dp
    problems = list(_source_problems(recipe, data, global_batch))
    if data.eval_source is not None:  # any non-empty held-out source fills a batch: size 0 stands for "no check"
        problems += _renamed(_source_problems(recipe, eval_data(data), 0))
    problems += _template_problems(recipe)
    problems += packing_problems(data)
    return problems
