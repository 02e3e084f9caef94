"""Moved to :mod:`ndparallel.hf` (issue 12: everything Hugging Face in one folder); these names stay importable.

``hf_tp_plan``, ``hf_fsdp_groups``, ``is_hf_model``, ``SUPPORTED_MODEL_TYPES``: :mod:`ndparallel.hf.plan`;
``GatherSequence``, ``TiedColwiseParallel``: :mod:`ndparallel.hf.styles`; ``apply_hf_attention``:
:mod:`ndparallel.hf.attention`; ``hf_parallelize_kwargs``: :mod:`ndparallel.hf.family`.
"""

from ndparallel.hf.attention import ATTENTION_RING, ATTENTION_SDPA, apply_hf_attention
from ndparallel.hf.family import hf_parallelize_kwargs
from ndparallel.hf.plan import SUPPORTED_MODEL_TYPES, hf_fsdp_groups, hf_tp_plan, is_hf_model
from ndparallel.hf.styles import GatherSequence, TiedColwiseParallel

__all__ = [
    "ATTENTION_RING",
    "ATTENTION_SDPA",
    "SUPPORTED_MODEL_TYPES",
    "GatherSequence",
    "TiedColwiseParallel",
    "apply_hf_attention",
    "hf_fsdp_groups",
    "hf_parallelize_kwargs",
    "hf_tp_plan",
    "is_hf_model",
]
