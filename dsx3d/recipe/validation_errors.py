"""pydantic's validation errors of a recipe as the checker's problems: one per key, each with the key path, the
value, the reason and the fix."""

from __future__ import annotations

from pydantic import ValidationError

from dsx3d.errors import Problem

# The fix for each kind of bad value pydantic reports, by its error type.
_FIXES = {
    "int_type": "write a whole number, unquoted (not true/false, not a string)",
    "bool_type": "write true or false",
    "float_type": "write a number such as 3.0e-4, unquoted",
    "finite_number": "write a finite number",
    "string_type": "write a string (quote it)",
    "literal_error": "use one of the values listed",
    "tuple_type": "write a list such as [0.9, 0.95]",
    "list_type": "write a list",
    "dict_type": "write a mapping",
}


def _problems_from(err: ValidationError) -> list[Problem]:
    by_key: dict[str, Problem] = {}
    for e in err.errors():
        # Drop pydantic's union-branch markers from the path: parallel.dp, not parallel.dp.constrained-int.
        loc = [p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or "constrained" in p or "function-" in p))]
        key = ".".join(str(p) for p in loc) or "(recipe)"
        if e["type"] == "extra_forbidden":
            problem = Problem(key, e.get("input"), "unknown key", "remove it or fix its spelling (see README: recipe keys)")
        elif e["type"] == "missing":
            problem = Problem(key, None, "required key is missing", f"add {key}")
        else:
            value = e.get("input")
            shown = "(section)" if isinstance(value, dict) else value
            reason = e["msg"].removeprefix("Value error, ")
            fix = _FIXES.get(e["type"], "use a value in the range given (see README: recipe keys)")
            problem = Problem(key, shown, reason, fix)
        if key in by_key and by_key[key].value == problem.value:  # the branches of a union (int or "auto")
            first = by_key[key]
            problem = Problem(key, first.value, f"{first.reason}, or {problem.reason[0].lower()}{problem.reason[1:]}", first.fix)
        by_key[key] = problem
    return list(by_key.values())
