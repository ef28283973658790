"""The docs' recipe-key table (docs/guide/recipes.md) is the user's reference: it lists every key the schema accepts and no key
it does not (a key added to dsx3d.recipe.schema without a row, or a row left after a key was renamed, fails)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from dsx3d.recipe.schema import Recipe

RECIPES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "recipes.md"


def _schema_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:  # an optional section (`X | None`): its row, then its keys
            keys.add(f"{prefix}{name}")
            annotation = models[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= _schema_keys(annotation, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def _table_keys() -> set[str]:
    text = RECIPES_PAGE.read_text()
    section = text[text.index("## Recipe keys") :]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    keys: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            keys |= set(re.findall(r"`([a-z_.]+)`", first_cell))
    return keys


def test_recipe_key_table_matches_the_schema() -> None:
    assert _table_keys() == _schema_keys(Recipe)
