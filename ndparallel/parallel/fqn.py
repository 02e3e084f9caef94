"""FQN patterns: the one meaning of a module-path pattern in every ndparallel table.

Tensor-parallel plans (``{pattern: ParallelStyle}``), context-parallel ``targets`` and the Hugging Face
plan all address modules by pattern, and all ask :func:`fqn_matches`. A pattern is a module path whose
atoms (the parts between dots) may hold shell wildcards: ``*`` matches any run of characters **inside
one atom** (it never crosses a dot), ``?`` one character, ``[...]`` one of a set. It matches a fully
qualified name with the same number of atoms whose atoms match one by one, case-sensitively::

    layers.*.attention      matches  layers.0.attention, layers.11.attention
                            not      layers.0.block.attention (one atom too many), layers.0, attention
    layers.*.feed_forward.w[13]      matches  layers.3.feed_forward.w1 and ...w3, not ...w2

This is how torch's ``parallelize_module`` walks a plan's keys (atom by atom down the module tree), so
ndparallel's checks see exactly the modules torch shards. The root module (FQN ``""``) matches no pattern.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from fnmatch import fnmatchcase
from typing import TypeVar

from torch import nn

__all__ = ["first_match", "fqn_matches", "matching_modules"]

T = TypeVar("T")


def fqn_matches(fqn: str, pattern: str) -> bool:
    """Whether module path ``fqn`` matches ``pattern`` (see the module docstring: ``*`` stays inside one atom)."""
    if not fqn:
        return False
    atoms, parts = fqn.split("."), pattern.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(a, p) for a, p in zip(atoms, parts, strict=True))


def first_match(fqn: str, table: Mapping[str, T]) -> T | None:
    """The value of the first pattern in ``table`` that ``fqn`` matches, or None."""
    return next((value for pattern, value in table.items() if fqn_matches(fqn, pattern)), None)


def matching_modules(model: nn.Module, pattern: str) -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, module)`` for every submodule of ``model`` that ``pattern`` matches, in ``named_modules`` order."""
    return ((name, module) for name, module in model.named_modules() if fqn_matches(name, pattern))
