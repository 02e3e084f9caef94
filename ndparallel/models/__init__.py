"""Model families, one folder each: ``transformer/`` (the reference decoder) and ``hf/`` (Hugging Face
``transformers`` decoders). Each hands the planners what they need through a
:class:`~ndparallel.parallel.family.ModelFamily`; ``builtin`` registers the built-in ones, at the first family
lookup. Adding a family: docs/architecture.md ("Adding a model family").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ndparallel.lazy import lazy_names

# Public name -> the module that defines it, imported on first use (PEP 562): a job's config reads
# TransformerConfig without the model's DTensor imports (the ``ndparallel train`` front process).
_EXPORTS: dict[str, str] = dict.fromkeys(
    ("CoreAttention", "PRESETS", "Transformer", "TransformerConfig"), "ndparallel.models.transformer"
)

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.models.transformer import PRESETS, CoreAttention, Transformer, TransformerConfig


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


__all__ = ["PRESETS", "CoreAttention", "Transformer", "TransformerConfig"]
