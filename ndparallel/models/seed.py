"""Per-name random seeds: the one rule that lets a part of a model (a pipeline stage) initialise exactly as
the whole model does (docs/pipeline-parallel.md#hugging-face-models)."""

from __future__ import annotations

import zlib

__all__ = ["name_seed"]


def name_seed(seed: int, fqn: str) -> int:
    """The generator seed of the parameter or module ``fqn`` of a model seeded with ``seed``: ``crc32`` of
    ``f"{seed}:{fqn}"`` (32 bits: the CPU generator's Mersenne twister keeps only the low 32 bits of a seed)."""
    return zlib.crc32(f"{seed}:{fqn}".encode())
