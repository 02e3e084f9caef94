"""Autograd functions the attention parity tests use to cut a full tensor into this rank's sequence rows and
put it back (shared by tests/distributed/test_ring_attention.py and tests/distributed/test_ulysses.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndparallel.parallel.context_parallel import gather_sequence, sequence_indices, shard_sequence


class ShardRows(torch.autograd.Function):
    """Full tensor (equal on every rank) -> this rank's rows; backward: the sum of every rank's row gradients."""

    @staticmethod
    def forward(ctx, x, balanced):
        ctx.shape, ctx.balanced = x.shape, balanced
        return shard_sequence(x, 1, dist.get_world_size(), dist.get_rank(), balanced)

    @staticmethod
    def backward(ctx, grad):
        idx = sequence_indices(ctx.shape[1], dist.get_world_size(), dist.get_rank(), ctx.balanced)
        full = grad.new_zeros(ctx.shape).index_copy(1, idx, grad)
        dist.all_reduce(full)
        return full, None


class GatherRows(torch.autograd.Function):
    """Local rows -> the full tensor on every rank; backward (upstream gradient equal on every rank): own rows."""

    @staticmethod
    def forward(ctx, x, balanced):
        ctx.balanced = balanced
        return gather_sequence(x, 1, dist.group.WORLD, balanced)

    @staticmethod
    def backward(ctx, grad):
        return shard_sequence(grad, 1, dist.get_world_size(), dist.get_rank(), ctx.balanced), None
