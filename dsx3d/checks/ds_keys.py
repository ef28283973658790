"""The DeepSpeed section checked against the typed key table: every key DeepSpeed reads without a type check (get_scalar_param, dict.get) has its type and range, and removed keys are refused."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from dsx3d.checks.ds_key_rules import RULES
from dsx3d.checks.ds_key_table import DEEPSPEED_VERSION, KEYS
from dsx3d.errors import Problem
from dsx3d.recipe.json_values import DSConfig, JSONValue

AUTO = "auto"  # left to dsx3d.recipe.ds_config.resolve_auto and the checker's `_auto_left` rule
_ABSENT = object()
_WORDS = {
    "bool": "true or false", "int": "an integer", "float": "a number", "str": "a string", "list": "a list",
    "dict": "a mapping", "section": "a mapping", "none": "null",
}


@dataclass(frozen=True)
class KeySpec:
    """What one key accepts: its types (table words: bool, int, float, ...), bounds and strings."""

    path: str
    types: tuple[str, ...]
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    why: str = ""
    reader: str = ""
    where: str = ""
    default: object = None

    @property
    def checked_here(self) -> bool:
        """DeepSpeed's pydantic models check their own keys (dsx3d.checks.ds_schema runs them)."""
        return not self.reader.startswith("pydantic:")

    def expected(self) -> str:
        words = [_WORDS.get(t, "any value") for t in self.types if not t.startswith("enum:")]
        enums = [v for t in self.types if t.startswith("enum:") for v in t[5:].split(",")]
        choices = list(self.choices) + [v for v in enums if v != AUTO]
        if choices:
            words = [w for w in words if w not in ("a string", "an integer")]
            words.insert(0, "one of " + ", ".join(choices))
        bounds = [f"{op} {_num(v)}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)) if v is not None]
        if bounds and words and words[0] in ("an integer", "a number"):
            words[0] += " " + " and ".join(bounds)
        return " or ".join(words)

    def type_ok(self, value: object) -> bool:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        for t in self.types:
            if (
                (t == "bool" and isinstance(value, bool))
                or (t == "int" and isinstance(value, int) and not isinstance(value, bool))
                or (t == "float" and number)
                or (t == "str" and isinstance(value, str))
                or (t == "list" and isinstance(value, list))
                or (t in ("dict", "section") and isinstance(value, dict))
                or (t == "none" and value is None)
                or (t == "any")
                or (t.startswith("enum:") and str(value) in t[5:].split(",") and not isinstance(value, bool))
            ):
                return True
        return False

    def range_ok(self, value: object) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return True
        return not (
            (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)
        )

    def choice_ok(self, value: object) -> bool:
        return not (self.choices and isinstance(value, str)) or value.lower() in {c.lower() for c in self.choices}


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _bound(bounds: str, name: str) -> float | None:
    for part in bounds.split(","):
        if part.startswith(name + "="):
            return float(part.split("=", 1)[1])
    return None


def spec(path: str) -> KeySpec:
    """The table's row for `path` with its hand-written rule (dsx3d.checks.ds_key_rules) applied."""
    kind, default, bounds, reader, where = KEYS[path]
    rule = RULES.get(path)
    types = (rule.type if rule and rule.type else kind).split("|")
    ge, gt, le, lt = (_bound(bounds, n) for n in ("ge", "gt", "le", "lt"))
    if rule is not None:
        ge, gt, le = rule.ge if rule.ge is not None else ge, rule.gt if rule.gt is not None else gt, rule.le if rule.le is not None else le
    return KeySpec(
        path, tuple(types), ge, gt, le, lt, rule.choices if rule else (), rule.why if rule else "", reader, where, default
    )


SPECS: dict[str, KeySpec] = {path: spec(path) for path in KEYS}


def _lookup(config: DSConfig, path: str) -> object:
    value: object = config
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def _problem(s: KeySpec, value: object) -> Problem | None:
    key = f"deepspeed.{s.path}"
    if "removed" in s.types:
        return Problem(
            key, value, f"DeepSpeed {DEEPSPEED_VERSION} refuses the whole config at start-up, on every rank: {str(s.default).rstrip('.')}",
            f"remove deepspeed.{s.path}",
        )
    if value == AUTO:
        return None
    where = f"{s.reader.replace('|', ', ')} in deepspeed/{s.where.split(' ')[0].split(':')[0]}"
    if not s.type_ok(value):
        reason = f"DeepSpeed reads it with no type check ({where}) and needs {s.expected()}"
        if isinstance(value, str) and "bool" in s.types:
            reason += f" (a non-empty string such as {value!r} is true to it)"
        return Problem(key, value, reason, f"give {s.expected()}")
    if not s.range_ok(value) or not s.choice_ok(value):
        kind = "out of range" if s.choice_ok(value) else "not a value DeepSpeed accepts"
        return Problem(key, value, f"{kind}: DeepSpeed needs {s.expected()}; {s.why}", f"give {s.expected()}")
    return None


def key_problems(config: DSConfig) -> list[Problem]:
    """Every value of `config` (a final DeepSpeed config) that DeepSpeed would read unchecked and then crash on
    or misread, and every key DeepSpeed refuses outright, each named `deepspeed.<path>`. Keys of DeepSpeed's
    pydantic sections are left to its own parsers (dsx3d.checks.ds_schema); "auto" to `_auto_left`."""
    problems: list[Problem] = []
    for path, s in SPECS.items():
        value = _lookup(config, path) if s.checked_here else _ABSENT  # under a non-mapping: absent
        problem = None if value is _ABSENT else _problem(s, value)
        if problem is not None:
            problems.append(problem)
    return problems


def without(config: DSConfig, problems: list[Problem]) -> DSConfig:
    """`config` without the values `problems` name (DeepSpeed would then use its defaults there), so that
    DeepSpeed's own parsers check the rest without failing again on the same values."""
    out = copy.deepcopy(config)
    for p in problems:
        parts = p.key.removeprefix("deepspeed.").split(".")
        parent: JSONValue = out
        for part in parts[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(parts[-1], None)
    return out
