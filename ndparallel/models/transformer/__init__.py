"""The reference Llama-style decoder as one family folder: ``presets`` (its shape and named sizes), ``model``
(the module), ``stage`` (a pipeline stage of it) and ``family`` (what the planners need to know about it)."""

from ndparallel.models.transformer.model import CoreAttention, Transformer
from ndparallel.models.transformer.presets import PRESETS, TransformerConfig

__all__ = ["PRESETS", "CoreAttention", "Transformer", "TransformerConfig"]
