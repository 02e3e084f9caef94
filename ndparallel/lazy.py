"""A package's public names, each imported from the module that defines it on first use (PEP 562).

Why: a process imports only what it uses. The ``ndparallel`` command's front process and a launched script's
runner parse arguments and read a config without DTensor, FSDP and DCP (about 0.5 CPU-s a process;
docs/architecture.md, "Tests"). A lazy package keeps the same imports under ``TYPE_CHECKING`` for static tools; a
guard test in tests/test_architecture.py holds its table, those imports and ``__all__`` to one list.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str,
    exports: Mapping[str, str],
    *,
    subpackages: Iterable[str] = (),
    fallback: Callable[[str], Any] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to its module, each of
    ``subpackages`` is imported as an attribute, any other name goes to ``fallback`` (else AttributeError). A
    resolved name is kept in the package's namespace, so each is looked up once."""
    namespace = vars(sys.modules[package])
    subpackages = tuple(subpackages)

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif name in subpackages:
            value = importlib.import_module(f"{package}.{name}")
        elif fallback is not None:
            return fallback(name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports, *subpackages})

    return __getattr__, __dir__
