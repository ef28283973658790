"""Reading a recipe's YAML strictly: duplicate keys and ambiguous scalars are errors, not silent choices."""

from __future__ import annotations

import re
from typing import Any

import yaml


class StrictYamlLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader that refuses a key given twice in one mapping and reads 1e-3 as a float."""


def _construct_mapping(loader: StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[object, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` keys may be overridden
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # unhashable: the base constructor reports it
            continue
        if first != key_node.start_mark.line + 1:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first given on line {first})", key_node.start_mark
            )
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


def _construct_scalar(loader: StrictYamlLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    return float(text.replace("_", "")) if "." in text or "e" in text.lower() else int(text.replace("_", ""))


def parse_yaml(text: str) -> Any:
    """YAML text through StrictYamlLoader."""
    return yaml.load(text, Loader=StrictYamlLoader)  # noqa: S506 (a SafeLoader subclass)


# YAML 1.2's float syntax (1e-3, 2E5, -1.5e+3, .5): YAML 1.1, which PyYAML implements, requires a dot and
# a signed exponent, so `lr: 1e-3` would be the string "1e-3".
_FLOAT_12 = re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][-+]?\d+)?$")


StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
StrictYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float12", _FLOAT_12, list("-+0123456789."))
StrictYamlLoader.add_constructor("tag:yaml.org,2002:float12", _construct_scalar)
