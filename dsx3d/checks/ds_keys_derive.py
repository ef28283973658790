"""DeepSpeed's config readers walked with `ast`: every key path they read, with its default, reader and place."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsx3d.checks.ds_keys_source import MISSING, UNKNOWN, Source, deepspeed_root, is_pydantic_model

__all__ = ["ENTRY", "HELPERS", "MISSING", "UNKNOWN", "Read", "deepspeed_root", "derive_reads"]

# config_utils.py: `param_dict.get(param_name, param_default_value)`, no type check
HELPERS = ("get_scalar_param", "get_list_param", "get_dict_param")
# Where the walk starts: DeepSpeedConfig reads the whole dict (`config` in __init__, `param_dict` in
# _initialize_params, `self._param_dict` in its checks); every reader is reached from there.
ENTRY = ("runtime/config.py", "DeepSpeedConfig")
# A section the engine reads after parsing, outside the config readers: `self._config.pipeline[...]` in the
# pipeline engine is the dict `get_pipeline_config` builds from the "pipeline" section.
ENGINE_READS = (("runtime/pipe/engine.py", "_config.pipeline", "pipeline"),)


@dataclass(frozen=True)
class Read:
    """One key read: its dotted path from the top of the config, its default (a literal, MISSING or
    UNKNOWN), how it is read (a helper, `dict.get`, `subscript`, or `pydantic:<module>:<class>` for a whole
    section given to a pydantic model), and the function that reads it."""

    path: str
    default: object
    reader: str
    where: str
    annotation: str = ""  # the annotation of the attribute a read is assigned to (`config.top_k: int | str`)


Paths = frozenset[str]
_EMPTY: Paths = frozenset()


@dataclass
class _Scope:
    """A function being walked: its module, class, the config paths and the constants its names hold."""

    rel: str
    cls: ast.ClassDef | None
    where: str
    env: dict[str, Paths]
    consts: dict[str, object]
    imports: dict[str, tuple[str, str]]
    loops: dict[str, tuple[str, dict[object, object]]]  # key name -> (value name, the constant dict looped over)
    annotations: dict[int, str] = field(default_factory=dict)  # id of a read's node -> its target's annotation


def _items_loop(loop: ast.For) -> tuple[ast.expr, str, str] | None:
    """`for key, value in X.items()`: (X, "key", "value")."""
    it, target = loop.iter, loop.target
    if (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items"
            and isinstance(target, ast.Tuple) and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)):
        key, value = (e.id for e in target.elts if isinstance(e, ast.Name))
        return it.func.value, key, value
    return None


class _Walker:
    """Follows dict values derived from the config through the readers' functions, recording reads."""

    def __init__(self, source: Source):
        self.source = source
        self.reads: list[Read] = []
        self.done: dict[tuple[str, ...], Paths] = {}

    def function(self, rel: str, fn: ast.FunctionDef, cls: ast.ClassDef | None, bound: dict[str, Paths], consts: dict[str, object]) -> Paths:
        """Walk `fn` with its parameters holding `bound` paths and `consts` values; the paths it returns."""
        key = (rel, cls.name if cls else "", fn.name, repr(sorted((k, sorted(v)) for k, v in bound.items())), repr(sorted(consts.items(), key=str)))
        if key in self.done:
            return self.done[key]
        self.done[key] = _EMPTY  # a recursive call sees no paths
        names = [a.arg for a in fn.args.args]
        defaults = dict(zip(names[len(names) - len(fn.args.defaults):], fn.args.defaults, strict=True))
        scope = _Scope(rel, cls, f"{rel}:{cls.name + '.' if cls else ''}{fn.name}", dict(bound), {}, {}, {})
        scope.consts = {n: self.source.value(rel, d) for n, d in defaults.items()} | consts
        for node in ast.walk(fn):
            loop = _items_loop(node) if isinstance(node, ast.For) else None
            if isinstance(node, ast.ImportFrom):  # imports inside the function
                target = self.source.resolve(node, rel.split("/")[:-1])
                scope.imports.update({a.asname or a.name: (target, a.name) for a in node.names if target})
            elif loop is not None:  # for key, default in CONSTANT_DICT.items()
                table = self.source.value(rel, loop[0])
                if isinstance(table, dict):
                    scope.loops[loop[1]] = (loop[2], table)
        self._annotate(fn, scope)
        expr = _Expr(self, scope)
        returns: Paths = _EMPTY
        for _ in range(3):  # assignments in any order: a few passes reach the fixed point
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    paths = expr.paths(node.value)
                    if paths:
                        scope.env[node.targets[0].id] = scope.env.get(node.targets[0].id, _EMPTY) | paths
        for node in ast.walk(fn):
            if isinstance(node, ast.Call | ast.Subscript | ast.DictComp):
                expr.paths(node)
            elif isinstance(node, ast.For):
                self._merge_loop(node, fn, expr)
                self._refusal(node, scope, expr)
            elif isinstance(node, ast.Return) and node.value is not None:
                returns |= expr.paths(node.value)
        self.done[key] = returns
        return returns

    def _annotate(self, fn: ast.FunctionDef, scope: _Scope) -> None:
        """`config = AutoEPConfig(); config.top_k = param_dict.get("top_k", "auto")`: the read takes the
        annotation of the attribute in the class (module_inject/auto_ep_config.py `parse_autoep_config`)."""
        classes: dict[str, ast.ClassDef] = {}
        assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)]
        for node in assigns:
            call, target = node.value, node.targets[0]
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and isinstance(target, ast.Name):
                found = _Expr(self, scope).lookup(call.func.id)
                if found and isinstance(found[1], ast.ClassDef):
                    classes[target.id] = found[1]
        for node in assigns:
            target = node.targets[0]
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in classes:
                for stmt in classes[target.value.id].body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == target.attr:
                        scope.annotations[id(node.value)] = ast.unparse(stmt.annotation)

    def _refusal(self, loop: ast.For, scope: _Scope, expr: _Expr) -> None:
        """`for key, message in REMOVED.items(): if key in section: raise ...(message)`: keys DeepSpeed
        refuses outright (runtime/config.py `_reject_removed_config_keys`); the default is the message."""
        parts = _items_loop(loop)
        table = self.source.value(scope.rel, parts[0]) if parts else None
        if parts is None or not isinstance(table, dict):
            return
        for node in ast.walk(loop):
            test = node.test if isinstance(node, ast.If) else None
            if (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
                    and test.left.id == parts[1] and isinstance(test.ops[0], ast.In)
                    and any(isinstance(n, ast.Raise) for n in node.body)):
                for p in sorted(expr.paths(test.comparators[0])):
                    self.reads.extend(Read(_join(p, str(k)), v, "removed", scope.where) for k, v in table.items())

    def _merge_loop(self, loop: ast.For, fn: ast.FunctionDef, expr: _Expr) -> None:
        """`for key, val in section.items(): config[key] = val` over a dict literal of defaults: each literal
        key is a read of the section (runtime/config.py `get_pipeline_config`)."""
        parts = _items_loop(loop)
        sections = expr.paths(parts[0]) if parts else _EMPTY
        if not sections:
            return
        stores = [n.targets[0] for n in loop.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Subscript)]
        assigned = {t.id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        for store in stores:
            literal = assigned.get(store.value.id) if isinstance(store.value, ast.Name) else None
            while isinstance(literal, ast.Name):  # config = default_pipeline
                literal = assigned.get(literal.id)
            if not isinstance(literal, ast.Dict):
                continue
            for k, v in zip(literal.keys, literal.values, strict=True):
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    for p in sections:
                        default = self.source.value(expr.s.rel, v)
                        self.reads.append(Read(_join(p, k.value), default, "dict.get", expr.s.where))

    def call(self, rel: str, node: ast.AST, cls: ast.ClassDef | None, args: list[Paths], consts: list[object],
             kwargs: dict[str, tuple[Paths, object]], where: str) -> Paths:
        """A call whose arguments carry config paths: into a reader function, a method, a class."""
        if isinstance(node, ast.ClassDef):
            if is_pydantic_model(rel, node, self.source):
                for p in sorted(set().union(*args, *(v[0] for v in kwargs.values()))):
                    self.reads.append(Read(p, MISSING, f"pydantic:{rel}:{node.name}", where))
                return _EMPTY
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is not None:
                self._bind(rel, init, node, [_EMPTY, *args], [None, *consts], kwargs)
            return _EMPTY
        if isinstance(node, ast.FunctionDef):
            return self._bind(rel, node, cls, args, consts, kwargs)
        return _EMPTY

    def _bind(self, rel: str, fn: ast.FunctionDef, cls: ast.ClassDef | None, args: list[Paths], consts: list[object],
              kwargs: dict[str, tuple[Paths, object]]) -> Paths:
        names = [a.arg for a in fn.args.args]
        bound = {n: p for n, p in zip(names, args, strict=False) if p}
        bound.update({n: p for n, (p, _) in kwargs.items() if p and n in names})
        values = {n: c for n, c in zip(names, consts, strict=False) if c not in (None, UNKNOWN)}
        values.update({n: c for n, (_, c) in kwargs.items() if n in names and c not in (None, UNKNOWN)})
        if not bound:
            return _EMPTY
        return self.function(rel, fn, cls, bound, values)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Expr:
    """The config paths an expression's value may hold, recording every key read on the way."""

    def __init__(self, walker: _Walker, scope: _Scope):
        self.w, self.s = walker, scope

    def const(self, node: ast.AST) -> object:
        if isinstance(node, ast.Name) and node.id in self.s.consts:
            return self.s.consts[node.id]
        return self.w.source.value(self.s.rel, node)

    def _read(self, paths: Paths, key: ast.AST, default: ast.AST | None, reader: str, node: ast.AST | None = None) -> Paths:
        if not paths:
            return _EMPTY
        if isinstance(key, ast.Name) and key.id in self.s.loops:  # for key, default in TABLE.items()
            value_name, table = self.s.loops[key.id]
            pairs = [(k, v if isinstance(default, ast.Name) and default.id == value_name else MISSING) for k, v in table.items()]
        else:
            pairs = [(self.const(key), MISSING if default is None else self.const(default))]
        out = set()
        for name, value in pairs:
            if isinstance(name, str) and name not in (UNKNOWN, MISSING):
                for p in sorted(paths):
                    out.add(_join(p, name))
                    annotation = self.s.annotations.get(id(node), "")
                    self.w.reads.append(Read(_join(p, name), value, reader, self.s.where, annotation))
        return frozenset(out)

    def paths(self, node: ast.AST) -> Paths:
        if isinstance(node, ast.Name):
            return self.s.env.get(node.id, _EMPTY)
        if isinstance(node, ast.Attribute) and node.attr == "_param_dict" and self.s.cls is not None and self.s.cls.name == ENTRY[1]:
            return frozenset({""})
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            return self._read(self.paths(node.value), node.slice, None, "subscript", node)
        if isinstance(node, ast.IfExp):
            return self.paths(node.body) | self.paths(node.orelse)
        if isinstance(node, ast.BoolOp):
            return _EMPTY.union(*(self.paths(v) for v in node.values))
        if isinstance(node, ast.DictComp):  # {k: d.get(k, ...) for k in (...)}: a selection of d's keys
            return self._selection(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        return _EMPTY

    def _selection(self, node: ast.DictComp) -> Paths:
        gen, value = node.generators[0], node.value
        if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute) or value.func.attr != "get":
            return _EMPTY
        base = self.paths(value.func.value)
        keys = self.const(gen.iter)
        default = value.args[1] if len(value.args) > 1 else ast.Constant(None)
        for k in keys if base and isinstance(keys, list) else ():
            self._read(base, ast.Constant(k), default, "dict.get")
        return base

    def _call(self, node: ast.Call) -> Paths:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and node.args:
            default = node.args[1] if len(node.args) > 1 else ast.Constant(None)
            return self._read(self.paths(func.value), node.args[0], default, "dict.get", node)
        if isinstance(func, ast.Attribute) and func.attr in ("copy", "deepcopy") and node.args:
            return self.paths(node.args[0])  # copy.copy(section)
        name = func.id if isinstance(func, ast.Name) else None
        if name in HELPERS and len(node.args) == 3:
            return self._read(self.paths(node.args[0]), node.args[1], node.args[2], name, node)
        plain = [a for a in node.args if not isinstance(a, ast.Starred)]
        args = [self.paths(a) for a in plain]
        consts = [self.const(a) for a in plain]
        kwargs = {k.arg or "**": (self.paths(k.value), self.const(k.value)) for k in node.keywords}
        if not (any(args) or any(p for p, _ in kwargs.values())):
            return _EMPTY
        if name is not None:
            found = self.lookup(name)
            return self.w.call(found[0], found[1], None, args, consts, kwargs, self.s.where) if found else _EMPTY
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" and self.s.cls:
            method = next((n for n in self.s.cls.body if isinstance(n, ast.FunctionDef) and n.name == func.attr), None)
            if method is not None:
                return self.w.call(self.s.rel, method, self.s.cls, [_EMPTY, *args], [None, *consts], kwargs, self.s.where)
        return _EMPTY

    def lookup(self, name: str) -> tuple[str, ast.AST] | None:
        if name in self.s.imports:
            target, original = self.s.imports[name]
            return self.w.source.lookup(target, original)
        return self.w.source.lookup(self.s.rel, name)


def _engine_reads(source: Source) -> Iterator[Read]:
    for rel, chain, section in ENGINE_READS:
        mod = source.module(rel)
        for node in ast.walk(mod.tree) if mod else ():
            target, key, default = None, None, None
            if isinstance(node, ast.Subscript):
                target, key = node.value, node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
                target, key, default = node.func.value, node.args[0], (node.args[1] if len(node.args) > 1 else ast.Constant(None))
            if target is not None and ast.unparse(target).endswith(chain) and isinstance(key, ast.Constant):
                value = MISSING if default is None else source.value(rel, default)
                yield Read(_join(section, str(key.value)), value, "subscript" if default is None else "dict.get", rel)


def derive_reads(root: Path | None = None) -> list[Read]:
    """Every key read by DeepSpeed's config readers, found from `DeepSpeedConfig` in the installed package."""
    source = Source(root or deepspeed_root())
    walker = _Walker(source)
    rel, cls = ENTRY
    found = source.lookup(rel, cls)
    if found is None or not isinstance(found[1], ast.ClassDef):
        raise LookupError(f"{cls} not found in deepspeed/{rel}")
    node = found[1]
    top = frozenset({""})
    for fn in node.body:
        if isinstance(fn, ast.FunctionDef):
            params = [a.arg for a in fn.args.args][1:]
            walker.function(rel, fn, node, {p: top for p in params if p in ("config", "param_dict")}, {})
    unique = {(r.path, r.reader, r.where, repr(r.default)): r for r in walker.reads + list(_engine_reads(source))}
    return [unique[k] for k in sorted(unique)]
