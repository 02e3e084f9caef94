"""Where a DTensor's local shard sits in its full tensor: what loaders and seeded inits write into each rank."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndparallel.errors import ConfigError

__all__ = ["local_region"]


def local_region(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the full tensor this rank holds: every dim for a plain tensor, the local shard's
    region for a DTensor (FSDP over TP gives strided shards: torch's own offset rule handles them)."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    shape, offset = _local_shape_and_offset(tensor)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _local_shape_and_offset(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Private torch API, isolated here: the DTensor's local shape and global offset (what DCP uses;
    # it knows FSDP's _StridedShard over TP). Present in torch 2.11-2.14; plain Shard/Replicate
    # placements fall back to torch.chunk arithmetic if it moves.
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return _chunk_shape_and_offset(tensor)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def _chunk_shape_and_offset(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, offset = list(tensor.shape), [0] * tensor.ndim
    coordinate = tensor.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise ConfigError(f"cannot locate the local shard of a DTensor placed {placement}")
        dim, parts = placement.dim % tensor.ndim, tensor.device_mesh.size(mesh_dim)
        chunk = -(-shape[dim] // parts)
        start = min(chunk * coordinate[mesh_dim], shape[dim])
        offset[dim] += start
        shape[dim] = min(chunk, shape[dim] - start)
    return tuple(shape), tuple(offset)
