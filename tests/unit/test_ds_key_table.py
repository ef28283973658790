"""The committed DeepSpeed key table (dsx3d.checks.ds_key_table) is what the installed DeepSpeed reads: the table
is re-derived from DeepSpeed's own config readers (their source, walked with ast, and their pydantic models)
and any difference fails, so a DeepSpeed with a new key fails here until the table is regenerated
(`python -m dsx3d.checks.ds_keys_build`) and the new key typed."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

from dsx3d.checks.ds_key_rules import RULES
from dsx3d.checks.ds_key_table import DEEPSPEED_VERSION, KEYS
from dsx3d.checks.ds_keys import SPECS
from dsx3d.checks.ds_keys_build import build_rows, differences
from dsx3d.checks.ds_keys_derive import HELPERS, derive_reads
from dsx3d.checks.ds_keys_source import Source, deepspeed_root

# Read by DeepSpeed only when "bf16" is absent (runtime/precision_config.py); dsx3d always writes "bf16".
_NOT_PARSED = {"bfloat16"}


@pytest.fixture(scope="module")
def derived() -> dict[str, tuple[str, object, str, str, str]]:
    return build_rows()


def test_the_table_is_what_the_installed_deepspeed_reads(derived: dict[str, tuple[str, object, str, str, str]]) -> None:
    assert DEEPSPEED_VERSION == importlib.metadata.version("deepspeed"), "regenerate: python -m dsx3d.checks.ds_keys_build"
    problems = differences(KEYS, derived)
    assert not problems, "\n".join([*problems, "regenerate: python -m dsx3d.checks.ds_keys_build, then type new keys"])


def test_a_key_missing_from_the_table_is_named(derived: dict[str, tuple[str, object, str, str, str]]) -> None:
    table = dict(KEYS)
    del table["gradient_clipping"]
    assert differences(table, derived) == [f"DeepSpeed reads 'gradient_clipping', which the table lacks: {derived['gradient_clipping']}"]


def test_every_module_calling_a_reader_helper_is_walked() -> None:
    """A config reader the walk from DeepSpeedConfig does not reach would hide its keys: every module of the
    installed DeepSpeed that calls get_scalar_param / get_list_param / get_dict_param reads a key in the table."""
    root = deepspeed_root()
    callers = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel == "runtime/config_utils.py":
            continue  # defines them
        text = path.read_text()
        if not any(h in text for h in HELPERS):
            continue
        tree = ast.parse(text)
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in HELPERS for n in ast.walk(tree)):
            callers.add(rel)
    walked = {where.split(":")[0] for row in KEYS.values() for where in row[4].split(" ")}
    assert callers and callers <= walked, callers - walked


def test_every_key_dsx3d_checks_has_a_type() -> None:
    """Keys DeepSpeed reads unchecked with a default of None or no default get their type from ds_key_rules."""
    untyped = [p for p, s in SPECS.items() if s.checked_here and ({"?", "any"} & set(s.types) or s.types == ("none",))]
    assert untyped == ["expert_parallel.load_balance_coeff"], untyped  # DeepSpeed refuses anything but None


def test_every_rule_is_about_a_key_of_the_table() -> None:
    assert not set(RULES) - set(KEYS)
    assert not [p for p in RULES if KEYS[p][3].startswith("pydantic:")]  # those are DeepSpeed's own to check


def test_accepted_strings_are_deepspeeds_constants() -> None:
    source = Source(deepspeed_root())
    for path, rule in RULES.items():
        if rule.choices_from:
            module, name = rule.choices_from.split(":")
            found = source.lookup(module, name)
            assert found is not None, rule.choices_from
            node = found[1]
            keys = node.keys if isinstance(node, ast.Dict) else [node]  # a dict's keys, a list's items
            value = [v for k in keys if k is not None for v in _items(source.value(found[0], k))]
            assert sorted(value) == sorted(rule.choices), (path, value)


def _items(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else [value]


def test_pydantic_sections_are_parsed_by_ds_schema() -> None:
    """DeepSpeed's pydantic sections are left to its own parsers: each must be one dsx3d.checks.ds_schema
    runs (the monitor parser reads tensorboard, wandb, csv_monitor and comet)."""
    from dsx3d.checks.ds_schema import _parsers

    parsed = {section for section, _, _ in _parsers()} | {"tensorboard", "wandb", "csv_monitor", "comet"}
    pydantic = {p.split(".")[0] for p, row in KEYS.items() if row[3].startswith("pydantic:")}
    assert pydantic - parsed == _NOT_PARSED


def test_the_walk_finds_the_keys_of_the_issue() -> None:
    paths = {r.path for r in derive_reads()}
    assert {"gradient_clipping", "activation_checkpointing.partition_activations", "sparse_gradients",
            "pipeline.use_reentrant", "checkpoint.parallel_write.pipeline_stage", "aio.block_size"} <= paths


def test_a_new_key_in_a_new_deepspeed_fails_until_the_table_has_it(tmp_path: Path, derived: dict[str, tuple[str, object, str, str, str]]) -> None:
    """A DeepSpeed whose config reader reads one more key (a tiny source tree standing in for it): the walk
    finds the key and the comparison with the committed table names it."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "config_utils.py").write_text("def get_scalar_param(d, k, v):\n    return d.get(k, v)\n")
    (runtime / "constants.py").write_text("SHINY = 'shiny_new_key'\nSHINY_DEFAULT = 0.5\n")
    (runtime / "config.py").write_text(
        "from .constants import *\nfrom .config_utils import get_scalar_param\n\n\n"
        "def get_shiny(param_dict):\n    return get_scalar_param(param_dict, SHINY, SHINY_DEFAULT)\n\n\n"
        "class DeepSpeedConfig:\n    def _initialize_params(self, param_dict):\n        self.shiny = get_shiny(param_dict)\n"
    )
    new = derive_reads(tmp_path)
    assert [(r.path, r.default, r.reader) for r in new] == [("shiny_new_key", 0.5, "get_scalar_param")]
    rows = build_rows(derive_reads() + new)
    assert differences(KEYS, rows) == [f"DeepSpeed reads 'shiny_new_key', which the table lacks: {rows['shiny_new_key']}"]
