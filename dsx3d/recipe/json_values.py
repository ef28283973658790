"""Free-form JSON values inside a recipe (model.config, deepspeed overrides): bounded in size and depth, reported by key path."""

from __future__ import annotations

import math

from dsx3d.boundary_types import DSConfig, JSONObject, JSONValue

__all__ = ["DSConfig", "JSONObject", "JSONValue", "MAX_MAPPING_VALUES"]

MAX_MAPPING_VALUES = 100_000
"""Values in model.config or deepspeed, counted through YAML aliases (a YAML "billion laughs" stays small
on disk and in memory, but not when walked or written out as JSON)."""


def _json_problem(value: object, where: str, budget: list[int], depth: int = 0) -> str | None:
    """Why `value` cannot be written as strict JSON (None when it can): keys must be strings, numbers
    finite, values JSON types; walks at most MAX_MAPPING_VALUES values and 64 levels."""
    budget[0] -= 1
    if budget[0] < 0:
        return f"holds more than {MAX_MAPPING_VALUES} values (YAML aliases expand when written out)"
    if depth > 64:
        return f"{where} is nested more than 64 levels deep"
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} = {value}: not a finite number"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has a key {key!r} that is not a string"
            problem = _json_problem(item, f"{where}.{key}", budget, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            problem = _json_problem(item, f"{where}[{i}]", budget, depth + 1)
            if problem:
                return problem
        return None
    return f"{where} is a {type(value).__name__}, which JSON cannot hold (quote it as a string?)"


def _check_json(value: JSONObject | None, where: str) -> JSONObject | None:
    if value is not None:
        problem = _json_problem(value, where, [MAX_MAPPING_VALUES])
        if problem:
            raise ValueError(problem)
    return value
