"""The mesh dimensions, outer -> inner, their size fields, and who shards parameters (FSDP) on them."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["EP_BORROWS", "MESH_DIMS", "SIZE_FIELDS", "divisors", "ep_mesh_problem", "fsdp_shards"]

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SIZE_FIELDS: tuple[str, ...] = tuple(f"{d}_size" for d in MESH_DIMS)
EP_BORROWS: tuple[str, ...] = ("dp_shard", "cp")
"""The dims expert parallelism takes its ranks from (their inner ``ep`` ranks); not a mesh dim of its own."""


def ep_mesh_problem(cfg: Any) -> str | None:
    """Why ``cfg.ep_size`` cannot borrow its ranks from dp_shard x cp of a resolved ``cfg``, or None."""
    ep = cfg.ep_size
    if ep == 1:
        return None
    borrowed = math.prod(getattr(cfg, f"{d}_size") for d in EP_BORROWS)
    if borrowed % ep:
        return (
            f"ep_size={ep} does not divide dp_shard_size x cp_size = {borrowed}: expert parallelism borrows its "
            f"ranks from them; choose an ep_size that divides {borrowed}"
        )
    return None


def fsdp_shards(cfg: Any) -> bool:
    """Whether FSDP shards parameters: over dp_shard x cp, so when either is > 1 (context-parallel ranks shard
    too). An unresolved ``-1`` counts as 1 until the config is resolved against a world size."""
    return cfg.dp_shard_size not in (1, -1) or cfg.cp_size not in (1, -1)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (none for 0), by trial division up to its square root: the
    candidate sizes of a dimension (and micro-batch counts) without counting to ``n``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
