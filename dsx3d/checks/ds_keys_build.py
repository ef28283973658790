"""Builds the DeepSpeed key table (ds_key_table.py) from the readers' reads and the pydantic models' fields; `python -m dsx3d.checks.ds_keys_build` rewrites it."""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.metadata
import sys
import types
import typing
from pathlib import Path

from dsx3d.checks.ds_keys_derive import MISSING, UNKNOWN, Read, derive_reads

# One row per key path: (type, default, range, reader, where). Types: bool, int, float, str, list, dict,
# section (a mapping of further keys), none (DeepSpeed's default is None), enum:<values>, any, removed, and "?"
# (read with no default: dsx3d.checks.ds_key_rules types it), joined by "|".
Row = tuple[str, object, str, str, str]
TABLE_PATH = Path(__file__).with_name("ds_key_table.py")


def _plain(value: object) -> object:
    """A default as a literal the table can hold."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, bool) or value is None or isinstance(value, str | float):
        return value
    if isinstance(value, int):
        return int(value)  # pp_int prints with commas
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _kind(value: object) -> str:
    if value in (MISSING, UNKNOWN):
        return "?"
    for name, cls in (("bool", bool), ("int", int), ("float", float), ("str", str), ("list", list), ("dict", dict)):
        if isinstance(value, cls):
            return name
    return "none" if value is None else "any"


def _annotation(annotation: object) -> tuple[str, list[type]]:
    """A pydantic field's annotation as a table type, and the models nested in it."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [_annotation(a) for a in typing.get_args(annotation)]
        kinds = sorted({k for kind, _ in parts for k in kind.split("|")})
        return "|".join(kinds), [m for _, models in parts for m in models]
    if origin is typing.Literal:
        return "enum:" + ",".join(str(a) for a in typing.get_args(annotation)), []
    if origin in (list, typing.List):  # noqa: UP006 (typing.List annotations)
        return "list", []
    if origin in (dict, typing.Dict):  # noqa: UP006
        return "dict", []
    if annotation is type(None):
        return "none", []
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return "enum:" + ",".join(str(m.value) for m in annotation), []
        if hasattr(annotation, "model_fields"):
            return "section", [annotation]
        for name, cls in (("bool", bool), ("int", int), ("float", float), ("str", str), ("list", list), ("dict", dict)):
            if issubclass(annotation, cls):
                return name, []
        if issubclass(annotation, Path):
            return "str", []
    return "any", []


def _source_annotation(text: str) -> str:
    """A class attribute's annotation, as written in DeepSpeed's source, as a table type."""
    def kinds(node: ast.expr) -> list[str]:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return kinds(node.left) + kinds(node.right)
        if isinstance(node, ast.Constant) and node.value is None:
            return ["none"]
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            if node.value.id == "Literal":
                values = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                return ["enum:" + ",".join(str(ast.literal_eval(v)) for v in values)]
            if node.value.id == "Optional":
                return kinds(node.slice) + ["none"]
            return kinds(node.value)
        name = node.id if isinstance(node, ast.Name) else ""
        plain = {"bool": "bool", "int": "int", "float": "float", "str": "str", "list": "list", "List": "list", "dict": "dict", "Dict": "dict"}
        return [plain.get(name, "any")]
    return "|".join(sorted(set(kinds(ast.parse(text, mode="eval").body))))


def _bounds(metadata: list[object]) -> str:
    """Ranges pydantic enforces (annotated_types Ge, Gt, Le, Lt)."""
    out = []
    for m in metadata:
        for attr in ("ge", "gt", "le", "lt"):
            if getattr(m, attr, None) is not None:
                out.append(f"{attr}={getattr(m, attr)}")
    return ",".join(out)


def _model_rows(path: str, model: typing.Any, reader: str, where: str) -> dict[str, Row]:
    """One row per field of a pydantic model read at `path`, nested models walked; a field is read under its
    alias and, DeepSpeed's models populating by name, under its name too."""
    rows: dict[str, Row] = {}
    for name, info in model.model_fields.items():
        kind, nested = _annotation(info.annotation)
        default = None if info.is_required() else _plain(info.get_default(call_default_factory=True))
        for key in dict.fromkeys([info.alias or name, name]):
            sub = f"{path}.{key}" if path else key
            rows[sub] = (kind, default, _bounds(info.metadata), reader, where)
            for inner in nested:
                rows.update(_model_rows(sub, inner, f"pydantic:{inner.__name__}", where))
    return rows


def _model(reader: str) -> typing.Any:
    """The pydantic class named by a `pydantic:<module>:<class>` read, imported from the installed DeepSpeed
    (only here, to build or re-derive the table: `dsx3d check` reads the committed table)."""
    _, rel, name = reader.split(":")
    module = "deepspeed." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return getattr(importlib.import_module(module), name)


def build_rows(reads: list[Read] | None = None) -> dict[str, Row]:
    """The table: every path DeepSpeed reads, with one type merged over its reads."""
    reads = derive_reads() if reads is None else reads
    rows: dict[str, Row] = {}
    for r in reads:
        if r.reader.startswith("pydantic:"):
            rows.update(_model_rows(r.path, _model(r.reader), "pydantic:" + r.reader.split(":")[2], r.where))
    by_path: dict[str, list[Read]] = {}
    for r in reads:
        if r.path:  # "" is the whole config (the monitor model reads its sections from the top)
            by_path.setdefault(r.path, []).append(r)
    for path, group in by_path.items():
        pydantic = [r for r in group if r.reader.startswith("pydantic:")]
        if pydantic:
            rows[path] = ("section", None, "", "pydantic:" + pydantic[0].reader.split(":")[2], _where(group))
            continue
        if path in rows:
            continue  # a field of a model read at a parent path
        removed = [r for r in group if r.reader == "removed"]
        if removed:
            rows[path] = ("removed", removed[0].default, "", "removed", _where(group))
            continue
        annotated = [r.annotation for r in group if r.annotation]
        kinds = {_source_annotation(annotated[0])} if annotated else {_kind(r.default) for r in group}
        kinds = kinds - {"?"} or kinds
        defaults = [r.default for r in group if r.default not in (MISSING, UNKNOWN)]
        if any(d is not None for d in defaults):
            kinds.discard("none")  # null only where every reader takes it (checkpoint: {} in one, None in another)
        readers = "|".join(sorted({r.reader for r in group}))
        rows[path] = ("|".join(sorted(kinds)), _plain(defaults[0]) if defaults else None, "", readers, _where(group))
    for path in list(rows):  # a path with keys below it is a section
        if any(other.startswith(path + ".") for other in rows) and "section" not in rows[path][0]:
            kind, default, bounds, reader, where = rows[path]
            kinds = {"section"} | ({"none"} if "none" in kind.split("|") else set())
            rows[path] = ("|".join(sorted(kinds)), default, bounds, reader, where)
    return dict(sorted(rows.items()))


def _where(group: list[Read]) -> str:
    return " ".join(sorted({r.where for r in group}))


def differences(table: dict[str, Row], derived: dict[str, Row]) -> list[str]:
    """How a committed table differs from the one derived from the installed DeepSpeed, one line a key."""
    out = [f"DeepSpeed reads {p!r}, which the table lacks: {derived[p]}" for p in derived if p not in table]
    out += [f"the table has {p!r}, which DeepSpeed no longer reads" for p in table if p not in derived]
    out += [f"{p!r} changed: table {table[p]}, DeepSpeed {derived[p]}" for p in table if p in derived and table[p] != derived[p]]
    return out


def render(rows: dict[str, Row]) -> str:
    version = importlib.metadata.version("deepspeed")
    lines = [
        f'"""DeepSpeed {version}\'s config keys, generated from its readers by dsx3d.checks.ds_keys_build: do not edit."""',
        "",
        "# Regenerate with `python -m dsx3d.checks.ds_keys_build` after a DeepSpeed upgrade;",
        "# tests/unit/test_ds_key_table.py re-derives it from the installed DeepSpeed and fails on any difference.",
        "# path: (type, default, range pydantic enforces, reader, where it is read (module:function))",
        "",
        f"DEEPSPEED_VERSION = {version!r}",
        "",
        "KEYS: dict[str, tuple[str, object, str, str, str]] = {",
    ]
    lines += [f"    {path!r}: {row!r}," for path, row in rows.items()]
    lines += ["}", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render(build_rows())
    if "--check" in argv:
        return 0 if TABLE_PATH.read_text() == text else 1
    TABLE_PATH.write_text(text)
    print(f"wrote {TABLE_PATH} ({text.count(chr(10)) - 10} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
