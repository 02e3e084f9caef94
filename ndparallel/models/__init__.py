"""Model families, one folder each: ``transformer/`` (the reference decoder) and ``hf/`` (Hugging Face
``transformers`` decoders). Each hands the planners what they need through a
:class:`~ndparallel.parallel.family.ModelFamily`; importing this package registers the built-in ones.
Adding a family: docs/architecture.md ("Adding a model family").
"""

from ndparallel.models.hf.family import FAMILY as _HF_FAMILY
from ndparallel.models.transformer import PRESETS, CoreAttention, Transformer, TransformerConfig
from ndparallel.models.transformer.family import FAMILY as _TRANSFORMER_FAMILY
from ndparallel.parallel.protocol import register_builtin_family

register_builtin_family(_HF_FAMILY)
register_builtin_family(_TRANSFORMER_FAMILY, default=True)  # a model no family claims gets the reference answers

__all__ = ["PRESETS", "CoreAttention", "Transformer", "TransformerConfig"]
