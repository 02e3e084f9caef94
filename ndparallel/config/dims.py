"""The mesh dimensions, outer -> inner, their size fields, and who shards parameters (FSDP) on them.

The degree rules (FSDP, data parallel, what ep leaves the experts' FSDP) take any object with the config's
``<dim>_size`` attributes: a resolved :class:`~ndparallel.config.parallelism.ParallelismConfig`, or the
planner's view of one (``ndparallel.estimate.mesh.MeshShape``), so both ask the one rule.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "DATA_PARALLEL_DIMS",
    "EP_BORROWS",
    "FSDP_DIMS",
    "MESH_DIMS",
    "SIZE_FIELDS",
    "data_parallel_size",
    "divisors",
    "ep_fsdp_size",
    "ep_mesh_problem",
    "fsdp_shards",
    "fsdp_size",
    "is_size",
]

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SIZE_FIELDS: tuple[str, ...] = tuple(f"{d}_size" for d in MESH_DIMS)
FSDP_DIMS: tuple[str, ...] = ("dp_shard", "cp")
"""The dims FSDP shards parameters over (context-parallel ranks shard too)."""
DATA_PARALLEL_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard")
"""The dims whose ranks get different batches."""
EP_BORROWS: tuple[str, ...] = ("dp_shard", "cp")
"""The dims expert parallelism takes its ranks from (their inner ``ep`` ranks); not a mesh dim of its own."""


def is_size(value: Any) -> bool:
    """Whether ``value`` is a resolved size (a mesh size, ``ep_size``, a pipeline count): an int >= 1, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def fsdp_size(cfg: Any) -> int:
    """FSDP's shard group size of a resolved ``cfg``: dp_shard x cp."""
    return math.prod(getattr(cfg, f"{d}_size") for d in FSDP_DIMS)


def data_parallel_size(cfg: Any) -> int:
    """How many different batches a resolved ``cfg`` processes at once: dp_replicate x dp_shard."""
    return math.prod(getattr(cfg, f"{d}_size") for d in DATA_PARALLEL_DIMS)


def ep_fsdp_size(cfg: Any) -> int:
    """Ranks the routed experts' FSDP shards over: what ``ep_size`` leaves of dp_shard x cp (1 without FSDP)."""
    return max(1, fsdp_size(cfg) // cfg.ep_size)


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
    return any(getattr(cfg, f"{d}_size") not in (1, -1) for d in FSDP_DIMS)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (none for 0), by trial division up to its square root: the
    candidate sizes of a dimension (and micro-batch counts) without counting to ``n``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
