"""Reduce per-rank metrics into the numbers a single process would print.

Each data-parallel (and context-parallel) rank sees a slice of the global batch, so its loss
is a local mean. ``average_over(mesh["dp_cp"], loss)`` turns it into the global mean on
every rank (equal-sized slices, as ndparallel's data loading gives); tensor-parallel ranks
already agree and need no reduction. ``all_gather_rows`` hands every rank the rows of all ranks, with a
gradient: what a statistic of the global batch needs when it must be computed by the model's own function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["all_gather_rows", "average_over"]


def _group(mesh_or_group: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"average_over needs a 1-D mesh (e.g. mesh['dp_cp']), got {mesh_or_group.ndim}-D")
        return mesh_or_group.get_group()
    return mesh_or_group


def average_over(mesh_or_group: DeviceMesh | dist.ProcessGroup | None, value: float | torch.Tensor) -> float:
    """Mean of ``value`` over the ranks of a 1-D mesh or process group (``None``: the world); a Python float.

    Without an initialised process group (a single process) the value is returned as is.
    """
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):  # averaged in fp32 or wider: a float64 loss keeps its digits
        tensor = value.detach().reshape(()).to(torch.promote_types(value.dtype, torch.float32)).clone()
    else:
        tensor = torch.tensor(float(value), dtype=torch.float64)
    if not dist.is_initialized():
        return tensor.item()
    group = _group(mesh_or_group)
    if dist.get_world_size(group) == 1:
        return tensor.item()
    if dist.get_backend(group) == "nccl" and tensor.device.type != "cuda":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, group=group)
    return tensor.item() / dist.get_world_size(group)


class _GatherRows(torch.autograd.Function):
    """Rows of every rank, concatenated in rank order; backward sums each rank's gradient of all rows (every
    rank differentiates its own copy of the gathered tensor) and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        rows = torch.tensor([x.shape[0]], device=x.device)
        counts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, rows, group=group)
        sizes = [int(c) for c in counts]
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.group, ctx.sizes, ctx.rank = group, sizes, dist.get_rank(group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` (any row counts) concatenated along dim 0 in rank order, differentiably: a loss each
    rank computes on the gathered rows, averaged over the group, has the gradient of one process."""
    return _GatherRows.apply(x, group)
