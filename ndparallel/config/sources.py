"""Where settings come from, read the same way for every section: the unique-key YAML loader, ``key=value``
overrides, and field coercion against a dataclass's annotations, with did-you-mean suggestions.

The order of the sources (defaults < file < environment < command line) is ``ParallelismConfig.from_sources``.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from ndparallel.errors import ConfigError, brief_repr

__all__ = [
    "MAX_YAML_VALUES",
    "UniqueKeyLoader",
    "coerce_fields",
    "did_you_mean",
    "load_yaml_mapping",
    "parse_overrides",
    "parse_scalar",
]


MAX_YAML_VALUES = 100_000
"""The most values (scalars, keys included) one YAML document may hold once its aliases are expanded; a config
holds hundreds. An alias bomb (``&a [*b, *b, ...]`` nested) expands to billions: refused while composing."""


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no tags, no code) that raises ConfigError for a mapping holding one key twice, and for
    a document whose aliases expand past :data:`MAX_YAML_VALUES` values (or refer to themselves)."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """The number of scalars under ``node`` with every alias expanded, counted once per shared node (``sizes``,
    by ``id``), so the work is the size of the text; ConfigError past the limit or for a cycle."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError("a YAML alias refers to the node that holds it (a cycle); a config cannot be recursive")
    if isinstance(node, yaml.ScalarNode):
        return 1
    open_nodes.add(key)
    children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
    total = 0
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_YAML_VALUES:
            raise ConfigError(
                f"YAML aliases (&anchor / *alias) expand this value past {MAX_YAML_VALUES:,} items (an alias bomb?); "
                "a config needs no such nesting: write the values out"
            )
    open_nodes.discard(key)
    sizes[key] = total
    return total


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


def did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def parse_scalar(text: str) -> Any:
    """``"2"`` -> 2, ``"true"`` -> True, ``"bf16"`` -> "bf16" (YAML scalar rules, safe)."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError:
        return text
    except RecursionError:
        raise ConfigError(f"value {brief_repr(text)} is YAML nested too deeply for a setting") from None


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["a=1", "b.c=x"]`` -> ``{"a": 1, "b.c": "x"}``; values follow YAML scalar rules."""
    result = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {brief_repr(item)} must look like key=value (e.g. tp_size=2)")
        try:
            result[key.strip()] = parse_scalar(value.strip())
        except ConfigError as err:
            raise ConfigError(f"override {key.strip()!r}: {err}") from None
    return result


def coerce_fields(cls: type, values: Mapping[str, Any], section: str) -> dict[str, Any]:
    """Check ``values`` against the dataclass ``cls``'s field annotations, naming ``section.field`` on error.

    YAML's safe loader reads ``3e-4`` (no dot) as the string ``'3e-4'``: numeric strings become
    floats for float fields; lists become tuples for tuple fields. Unknown keys raise with a
    did-you-mean suggestion.
    """
    hints = typing.get_type_hints(cls)
    result = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown field {section}.{key}; known: {sorted(hints)}{did_you_mean(key, hints)}")
        result[key] = _coerce(value, hints[key], f"{section}.{key}")
    return result


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and not isinstance(value, bool):
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
            inner = typing.get_args(option)
            if len(value) == len(inner):
                return tuple(_coerce(v, t, f"{name}[{i}]") for i, (v, t) in enumerate(zip(value, inner, strict=True)))
    wanted = " or ".join(_type_name(o) for o in options)
    raise ConfigError(f"{name}={brief_repr(value)} must be {wanted}")


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) is tuple:
        return f"a list of {len(typing.get_args(annotation))} numbers"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        annotation, str(annotation)
    )


def load_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML file with the safe loader; it must hold a mapping."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a folder, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    except ConfigError as err:  # a duplicate key
        raise ConfigError(f"{path}: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not a text file (byte {err.start} is not UTF-8); a config is YAML text") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply for a config") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of key: value, got {type(data).__name__}")
    return data
