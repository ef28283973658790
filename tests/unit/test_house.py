"""The house rules of the package, read from its source: each parallel feature has one home, packages import
downwards only (no cycle, imports inside functions included), modules stay small, and the pipeline registry is
what every reader of a schedule name reads. The layer contracts themselves run as `lint-imports` (setup.cfg)."""

from __future__ import annotations

import ast
import graphlib
import math
import typing
from pathlib import Path

import pytest

from dsx3d.pipeline import registry
from dsx3d.recipe.schema import ParallelSection

PACKAGE = Path(__file__).resolve().parents[2] / "dsx3d"
MAX_MODULE_LINES = 400
MAX_SCHEDULE_NAME_FILES = 1


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _top(dotted: str) -> str:
    """dsx3d.a.b -> dsx3d.a (a top-level package or module)."""
    return ".".join(dotted.split(".")[:2])


def _imports(path: str, tree: ast.Module) -> set[str]:
    """Top-level dsx3d packages and modules `tree` imports, anywhere but in a TYPE_CHECKING block."""
    here = path[:-3].replace("/", ".").removesuffix(".__init__")
    skip, out = _type_checking_nodes(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + (path.endswith("__init__.py"))]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target == "dsx3d":
                out.update(f"dsx3d.{a.name}" for a in node.names)
            elif target.startswith("dsx3d."):
                out.add(_top(target))
        elif isinstance(node, ast.Import):
            out.update(_top(a.name) for a in node.names if a.name.startswith("dsx3d."))
    return out


def test_no_cycle_between_top_level_packages_and_modules() -> None:
    """Imports inside functions count (they run), type-checking imports do not. The package root `dsx3d`
    (its lazy `dsx3d.Trainer`) is the public face and may import anything; nothing imports it."""
    graph: dict[str, set[str]] = {}
    for path, tree in _modules().items():
        if path == "dsx3d/__init__.py":
            continue
        graph.setdefault(_top(path[:-3].replace("/", ".")), set()).update(_imports(path, tree))
    for node, targets in graph.items():
        targets.discard(node)
        assert "dsx3d" not in targets, f"{node} imports the package root"
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle between dsx3d's top-level packages: {' -> '.join(err.args[1])}")


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check above can fail: a graph with a function-level import back is a cycle."""
    tree = ast.parse("def f():\n    from dsx3d.cli import main\n")
    assert _imports("dsx3d/models/x.py", tree) == {"dsx3d.cli"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"dsx3d.cli": {"dsx3d.models"}, "dsx3d.models": {"dsx3d.cli"}}).prepare()
    skipped = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsx3d.cli import main\n")
    assert _imports("dsx3d/models/x.py", skipped) == set()


def test_no_module_over_400_lines() -> None:
    long = {p: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_each_schedule_name_is_a_literal_in_one_file() -> None:
    """Every other reader (schema, CLI choices, planner, estimator, engine, verify) takes them from the
    registry, so a new schedule is one module and one registry entry: each name is spelled in its own module only."""
    names = set(registry.SCHEDULE_NAMES)
    files: dict[str, set[str]] = {name: set() for name in names}
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                files[node.value].add(path)
    assert all(len(where) <= MAX_SCHEDULE_NAME_FILES for where in files.values()), files


def test_every_reader_of_a_schedule_name_reads_the_registry() -> None:
    """The recipe schema, the CLI choices and the planner's defaults are the registry's names."""
    import argparse

    from dsx3d.cli import cmd_estimate, cmd_verify
    from dsx3d.planner.search import enumerate_setups

    assert typing.get_args(ParallelSection.model_fields["schedule"].annotation) == registry.SCHEDULE_NAMES
    assert ParallelSection().schedule == registry.DEFAULT_SCHEDULE
    for command in (cmd_estimate, cmd_verify):
        parser = argparse.ArgumentParser()
        command.register(parser.add_subparsers())
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (child,) = sub.choices.values()
        (option,) = [a for a in child._actions if "--schedule" in a.option_strings]
        assert tuple(option.choices) == registry.SCHEDULE_NAMES
    default = enumerate_setups.__kwdefaults__["schedules"]
    assert default == registry.SCHEDULE_NAMES


@pytest.mark.parametrize("name", registry.SCHEDULE_NAMES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_each_schedule_model_is_within_one_f_one_b_and_the_ideal(name: str, pp: int, m: int) -> None:
    """A schedule's step is at least the m micro-batch times of work and at most 1F1B's m + p - 1; its idle
    fraction is in [0, 1); no stage holds more micro-batches than 1F1B's first stage, min(p, m), except that a
    schedule over v > 1 virtual stages may hold interleaving's bound: rank 0 runs (v - 1) p + 2 (p - 1) chunk
    forwards before its first backward, p + (p - 1) / v stage micro-batches' worth (Narayanan et al. 2021), and
    never more than the m micro-batches of the step."""
    spec = registry.get_schedule(name)
    units = spec.pipeline_units(pp, m, None)
    assert m - 1e-9 <= units <= m + pp - 1 + 1e-9
    assert 0.0 <= spec.bubble(pp, m) < 1.0
    assert spec.bubble(1, m) == 0.0
    held = [spec.held_micro_batches(s, pp, m, None) for s in range(pp)]
    v = spec.virtual_stages
    bound = min(pp if v == 1 else pp + math.ceil((pp - 1) / v), m)
    assert all(1 <= h <= bound for h in held)


def test_an_unknown_schedule_is_named() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        registry.get_schedule("gpipe")
