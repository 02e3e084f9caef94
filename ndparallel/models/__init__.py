"""Model families, one folder each: ``transformer/`` (the reference decoder) and ``hf/`` (Hugging Face
``transformers`` decoders). Each hands the planners what they need through a
:class:`~ndparallel.parallel.family.ModelFamily`; ``builtin`` registers the built-in ones, at the first family
lookup. Adding a family: docs/architecture.md ("Adding a model family").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it, imported on first use (PEP 562): a job's config reads
# TransformerConfig without the model's DTensor imports (the ``ndparallel train`` front process).
_EXPORTS: dict[str, str] = dict.fromkeys(
    ("CoreAttention", "PRESETS", "Transformer", "TransformerConfig"), "ndparallel.models.transformer"
)

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.models.transformer import PRESETS, CoreAttention, Transformer, TransformerConfig


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ndparallel.models' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = ["PRESETS", "CoreAttention", "Transformer", "TransformerConfig"]
