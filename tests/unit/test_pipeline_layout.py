"""`parallel.pipeline_layout`: Megatron-style layout strings parsed into decoder layers per stage, bad ones refused
with the key and the reason, and the layout equal to the `parallel.stage_layers` it stands for."""

from __future__ import annotations

import pytest

from dsx3d.errors import UserError
from dsx3d.pipeline.split import layout_string, parse_layout
from dsx3d.recipe.schema import recipe_from_dict


@pytest.mark.parametrize(
    "layout,counts",
    [
        ("Et*3|t*4|tttL", [3, 4, 3]),
        ("E|(tt|)*2t*3L", [0, 2, 2, 3]),
        ("t t, t|t", [3, 1]),
        ("Ettt|tL", [3, 1]),
        ("E|t*8|L", [0, 8, 0]),
    ],
)
def test_layouts_parse(layout: str, counts: list[int]) -> None:
    assert parse_layout(layout) == counts
    assert parse_layout(layout_string(counts)) == counts


@pytest.mark.parametrize(
    "layout,reason",
    [
        ("Ett|Ett", "E (the embedding)"),
        ("tLt|t", "L (the head and loss)"),
        ("Ex|t", "unknown symbol"),
        ("(tt", "unbalanced '('"),
        ("tt)|t", "unbalanced ')'"),
        ("*3", "without a symbol"),
        ("t*", "needs a count"),
        ("t*0", "needs a count"),
        ("(t*1000000)*1000000", "needs a count"),
    ],
)
def test_bad_layouts_are_refused_with_the_reason(layout: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_layout(layout)
    with pytest.raises(UserError) as err:
        recipe_from_dict({"model": {"name_or_path": "x"}, "parallel": {"pp": 2, "pipeline_layout": layout}})
    assert "parallel.pipeline_layout" in str(err.value)


def test_a_layout_sets_stage_layers_and_excludes_it() -> None:
    recipe = recipe_from_dict({"model": {"name_or_path": "x"}, "parallel": {"pp": 2, "pipeline_layout": "Et*3|tL"}})
    assert recipe.parallel.stage_layers == [3, 1]
    with pytest.raises(UserError, match="not both"):
        recipe_from_dict(
            {"model": {"name_or_path": "x"}, "parallel": {"pp": 2, "pipeline_layout": "Et|tL", "stage_layers": [1, 1]}}
        )
