"""DeepSpeed's installed source, parsed with `ast`: its modules, names resolved across imports, constants evaluated."""

from __future__ import annotations

import ast
import importlib.util
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MISSING = "<missing>"  # a key read by subscript, with no default
UNKNOWN = "<unknown>"  # a value the evaluator cannot work out


def deepspeed_root() -> Path:
    """The installed deepspeed package's folder, found without importing it."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("deepspeed is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass
class _Module:
    rel: str
    tree: ast.Module
    names: dict[str, ast.AST] = field(default_factory=dict)  # defs and constant assignments
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module rel, name)
    star: list[str] = field(default_factory=list)  # modules imported with *


class Source:
    """The deepspeed package's modules, parsed on demand, and name resolution across their imports."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, _Module | None] = {}

    def module(self, rel: str) -> _Module | None:
        if rel not in self.modules:
            path = self.root / rel
            self.modules[rel] = self._parse(rel, path) if path.is_file() else None
        return self.modules[rel]

    def _parse(self, rel: str, path: Path) -> _Module:
        mod = _Module(rel, ast.parse(path.read_text(), filename=rel))
        package = rel.rsplit("/", 1)[0].split("/") if "/" in rel else []
        if rel.endswith("__init__.py"):
            package = rel.split("/")[:-1]
        for node in mod.tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                mod.names[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        mod.names[target.id] = node.value
            elif isinstance(node, ast.ImportFrom):
                target_rel = self.resolve(node, package)
                if target_rel is None:
                    continue
                for alias in node.names:
                    if alias.name == "*":
                        mod.star.append(target_rel)
                    else:
                        mod.imports[alias.asname or alias.name] = (target_rel, alias.name)
        return mod

    def resolve(self, node: ast.ImportFrom, package: list[str]) -> str | None:
        """The module file (relative to the package root) an import from `package` names; None outside DeepSpeed."""
        if node.level:
            base = package[: len(package) - node.level + 1]
        elif node.module and node.module.split(".")[0] == "deepspeed":
            base = []
        else:
            return None
        parts = base + (node.module.split(".") if node.module else [])
        parts = parts[1:] if parts[:1] == ["deepspeed"] else parts
        stem = "/".join(parts)
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if (self.root / candidate).is_file():
                return candidate
        return None

    def lookup(self, rel: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> tuple[str, ast.AST] | None:
        """(module, node) defining `name` as seen from module `rel`: a def, a class or a constant's value."""
        mod = self.module(rel)
        if mod is None or (rel, name) in seen:
            return None
        seen = seen | {(rel, name)}
        if name in mod.names:
            return rel, mod.names[name]
        if name in mod.imports:
            target, original = mod.imports[name]
            found = self.lookup(target, original, seen)
            if found is None and self.module(target) is not None:
                sub = target.removesuffix("__init__.py") + f"{original}.py"  # `from pkg import module`
                return (sub, ast.Module(body=[], type_ignores=[])) if (self.root / sub).is_file() else None
            return found
        for star in mod.star:
            found = self.lookup(star, name, seen)
            if found is not None:
                return found
        return None

    def value(self, rel: str, node: ast.AST) -> object:
        """A constant expression's value, names resolved through the module's imports; UNKNOWN otherwise."""
        try:
            return _Eval(self, rel).eval(node)
        except Unknown:
            return UNKNOWN


class Unknown(Exception):
    pass


_CALLS: dict[str, Callable[..., object]] = {"int": int, "float": float, "str": str, "bool": bool, "pp_int": lambda v, *_: int(v)}  # pp_int(5e8)
_BINOPS: dict[type[ast.operator], Callable[[object, object], object]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.FloorDiv: operator.floordiv,
}


class _Eval:
    def __init__(self, source: Source, rel: str):
        self.source, self.rel = source, rel

    def eval(self, node: ast.AST) -> object:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            found = self.source.lookup(self.rel, node.id)
            if found is None or isinstance(found[1], ast.FunctionDef | ast.ClassDef | ast.Module):
                raise Unknown(node.id)
            return _Eval(self.source, found[0]).eval(found[1])
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # a class constant
            found = self.source.lookup(self.rel, node.value.id)
            if found is not None and isinstance(found[1], ast.ClassDef):
                for stmt in found[1].body:
                    if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.attr for t in stmt.targets):
                        return _Eval(self.source, found[0]).eval(stmt.value)
            raise Unknown(node.attr)
        if isinstance(node, ast.JoinedStr):  # f"... {CONSTANT} ..."
            return "".join(str(self.eval(v.value if isinstance(v, ast.FormattedValue) else v)) for v in node.values)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return _BINOPS[ast.Sub](0, self.eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](self.eval(node.left), self.eval(node.right))
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return [self.eval(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self.eval(k): self.eval(v) for k, v in zip(node.keys, node.values) if k is not None}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
            return _CALLS[node.func.id](*(self.eval(a) for a in node.args))
        raise Unknown(ast.dump(node)[:60])


def is_pydantic_model(rel: str, cls: ast.ClassDef, source: Source, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a class is a pydantic model (DeepSpeedConfigModel or BaseModel among its bases)."""
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        if name in ("DeepSpeedConfigModel", "BaseModel"):
            return True
        found = source.lookup(rel, name) if name and name not in seen else None
        if found and isinstance(found[1], ast.ClassDef) and is_pydantic_model(found[0], found[1], source, seen | {name}):
            return True
    return False
