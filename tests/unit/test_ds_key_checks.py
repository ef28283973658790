"""Generated from the DeepSpeed key table: every key DeepSpeed reads without a type check is fed a value of a
wrong type and, where it has a range or a set of accepted strings, one outside it; each is refused by name
(dsx3d.checks.ds_keys). The keys of DeepSpeed's pydantic sections get the same through DeepSpeed's own
parsers (dsx3d.checks.ds_schema). Values DeepSpeed takes (its defaults, an int for a float, "auto",
accepted strings in any case) pass. Pure: no processes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsx3d.checks import check_recipe
from dsx3d.checks.ds_keys import SPECS, KeySpec, key_problems
from dsx3d.recipe.schema import recipe_from_dict
from tests.helpers.recipes import tiny_recipe_dict

CHECKED = sorted(p for p, s in SPECS.items() if s.checked_here)
PYDANTIC = sorted(p for p, s in SPECS.items() if not s.checked_here and not p.startswith("bfloat16"))


def _nested(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out  # type: ignore[no-any-return]


def wrong_type(s: KeySpec, candidates: tuple[Any, ...] = ("no", 5, [1], {"x": 1})) -> Any:
    """The first value of another type than the key takes ("no" first: DeepSpeed would read it as true)."""
    return next(v for v in candidates if not s.type_ok(v))


def out_of_range(s: KeySpec) -> list[Any]:
    """Values just outside the key's bounds and, for a key with accepted strings, one that is not."""
    integer = "float" not in s.types
    out: list[Any] = []
    if s.ge is not None:
        out.append(int(s.ge) - 1 if integer else s.ge - 0.5)
    if s.gt is not None:
        out.append(int(s.gt) if integer else s.gt)
    if s.le is not None:
        out.append(int(s.le) + 1 if integer else s.le + 0.5)
    if s.lt is not None:
        out.append(s.lt)
    if s.choices:
        out.append("not-a-choice")
    return out


def _cases(paths: list[str]) -> list[tuple[str, Any]]:
    cases = []
    for path in paths:
        s = SPECS[path]
        if s.types == ("any",) or "any" in s.types:
            continue  # nothing is of a wrong type
        cases.append((path, wrong_type(s) if "removed" not in s.types else True))
        cases += [(path, v) for v in out_of_range(s)]
    return cases


CASES = _cases(CHECKED)


@pytest.mark.parametrize(("path", "value"), CASES, ids=[f"{p}={v!r}" for p, v in CASES])
def test_every_wrong_value_is_refused_by_name(path: str, value: Any) -> None:
    problems = key_problems(_nested(path, value))
    assert [(p.key, p.value) for p in problems] == [(f"deepspeed.{path}", value)], problems
    s = SPECS[path]
    assert "removed" in s.types or s.expected() in problems[0].reason


def test_the_sample_covers_the_table() -> None:
    """Every checked key gets a wrong type; every key with a range or accepted strings a value outside it."""
    assert {p for p, _ in CASES} == set(CHECKED)
    ranged = [p for p in CHECKED if out_of_range(SPECS[p])]
    assert len(CASES) == len(CHECKED) + sum(len(out_of_range(SPECS[p])) for p in ranged)


DEFAULTED = [p for p in CHECKED if SPECS[p].default is not None and "removed" not in SPECS[p].types]


@pytest.mark.parametrize("path", DEFAULTED)
def test_deepspeeds_own_default_passes(path: str) -> None:
    assert not key_problems(_nested(path, SPECS[path].default))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("gradient_clipping", 1),  # an int where DeepSpeed's default is a float
        ("gradient_clipping", 0.0),
        ("gradient_predivide_factor", 2),
        ("communication_data_type", "FP32"),  # DeepSpeed lower-cases it
        ("checkpoint.tag_validation", "warn"),  # DeepSpeed upper-cases it
        ("steps_per_print", None),
        ("train_batch_size", "auto"),  # resolved by dsx3d; one left is `_auto_left`'s
        ("expert_parallel.top_k", "auto"),
        ("pipeline.use_reentrant", None),
        ("datastates_ckpt", {"path": "/tmp"}),
    ],
)
def test_values_deepspeed_uses_correctly_pass(path: str, value: Any) -> None:
    assert not key_problems(_nested(path, value))


def test_the_issue_examples_are_refused_at_once_by_dsx3d_check() -> None:
    overrides = {
        "gradient_clipping": "x",
        "sparse_gradients": "no",
        "activation_checkpointing": {"partition_activations": "no"},
        "gradient_predivide_factor": -2.0,
        "pipeline": {"activation_checkpoint_interval": "2"},
        "zero_optimization": {"reduce_bucket_size": "big"},  # DeepSpeed's pydantic parser, reported with them
    }
    recipe = recipe_from_dict(tiny_recipe_dict(deepspeed=copy.deepcopy(overrides)))
    errors = sorted(p.key for p in check_recipe(recipe, data=False) if p.severity == "error")
    assert errors == sorted(f"deepspeed.{k}" for k in (
        "gradient_clipping", "sparse_gradients", "activation_checkpointing.partition_activations",
        "gradient_predivide_factor", "pipeline.activation_checkpoint_interval", "zero_optimization.reduce_bucket_size",
    ))


def test_dsx3d_check_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dsx3d.cli import main

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe_dict(deepspeed={"steps_per_print": "often"})))
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert "deepspeed.steps_per_print = 'often'" in out and "an integer >= 1" in out and "Traceback" not in out


def _pydantic_cases() -> list[tuple[str, Any]]:
    """1.5 first: pydantic's lax mode takes "no" as false and "5" as 5, and a leaf_module list takes one string."""
    cases = []
    for path in PYDANTIC:
        s = SPECS[path]
        if "any" not in s.types:
            cases.append((path, wrong_type(s, (1.5, "x", [1], {"x": 1}))))
        cases += [(path, v) for v in out_of_range(s)]
    return cases


PYDANTIC_CASES = _pydantic_cases()
# Its model validator raises a TypeError, which ds_schema reports for the whole zero_optimization section.
_NAMED_BY_SECTION = {"zero_optimization.leaf_module": "deepspeed.zero_optimization"}


def test_deepspeeds_own_parsers_refuse_every_wrong_value_of_their_sections() -> None:
    """One pass over every key of DeepSpeed's pydantic sections, through ds_schema (DeepSpeed imported once).
    A union-typed field is named with pydantic's member tag (`...zenflow.select_interval.int`)."""
    from dsx3d.checks.ds_schema import schema_problems

    missed = []
    for path, value in PYDANTIC_CASES:
        keys = {p.key for p in schema_problems(_nested(path, value), 1)}
        name = _NAMED_BY_SECTION.get(path, f"deepspeed.{path}")
        if not any(k == name or k.startswith(name + ".") for k in keys):
            missed.append((path, value, keys))
    assert not missed, missed
    assert len(PYDANTIC_CASES) > len(PYDANTIC)
