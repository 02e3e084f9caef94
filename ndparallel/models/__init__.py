"""Reference models: a Llama-style decoder and its presets."""

from ndparallel.models.config import PRESETS, TransformerConfig
from ndparallel.models.transformer import CoreAttention, Transformer

__all__ = ["PRESETS", "CoreAttention", "Transformer", "TransformerConfig"]
