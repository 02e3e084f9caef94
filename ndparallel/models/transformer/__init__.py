"""The reference Llama-style decoder as one family folder: ``presets`` (its shape and named sizes), ``model``
(the module), ``stage`` (a pipeline stage of it) and ``family`` (what the planners need to know about it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ndparallel.lazy import lazy_names

# Public name -> its module, imported on first use (PEP 562): ``presets`` needs no DTensor, ``model`` does.
_EXPORTS: dict[str, str] = {
    "CoreAttention": "ndparallel.models.transformer.model",
    "Transformer": "ndparallel.models.transformer.model",
    "PRESETS": "ndparallel.models.transformer.presets",
    "TransformerConfig": "ndparallel.models.transformer.presets",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.models.transformer.model import CoreAttention, Transformer
    from ndparallel.models.transformer.presets import PRESETS, TransformerConfig


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


__all__ = ["PRESETS", "CoreAttention", "Transformer", "TransformerConfig"]
