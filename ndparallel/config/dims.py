"""The mesh dimensions, outer -> inner, their size fields, and who shards parameters (FSDP) on them."""

from __future__ import annotations

from typing import Any

__all__ = ["MESH_DIMS", "SIZE_FIELDS", "fsdp_shards"]

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SIZE_FIELDS: tuple[str, ...] = tuple(f"{d}_size" for d in MESH_DIMS)


def fsdp_shards(cfg: Any) -> bool:
    """Whether FSDP shards parameters: over dp_shard x cp, so when either is > 1 (context-parallel ranks shard
    too). An unresolved ``-1`` counts as 1 until the config is resolved against a world size."""
    return cfg.dp_shard_size not in (1, -1) or cfg.cp_size not in (1, -1)
