"""A YAML safe loader that refuses duplicate keys: PyYAML keeps the last of two equal keys without a word."""

from __future__ import annotations

from typing import Any

import yaml

from ndparallel.errors import ConfigError

__all__ = ["UniqueKeyLoader"]


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no tags, no code) that raises ConfigError for a mapping holding one key twice."""


def _construct_unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges override on purpose
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise ConfigError(
                    f"duplicate key {key!r} on lines {seen[key]} and {line}: YAML would silently keep the last one; "
                    "remove the other"
                )
            seen[key] = line
        except TypeError:  # an unhashable key: SafeLoader's own error follows
            continue
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)
