"""Gradient buckets: parameters grouped into size-capped flat buffers, each all-reduced as ONE collective.

One collective per bucket instead of one per parameter: a transformer has hundreds of small
tensors (norm weights, biases) and every collective pays a fixed launch and synchronisation
cost; a few large flat buffers also keep the network (or gloo's TCP ring) busy. The price is a
copy of each gradient into the buffer and back, memory-bandwidth work that is small next to
the transfer. Copying (rather than making ``param.grad`` a view of the buffer, as torch DDP's
``gradient_as_bucket_view`` does) keeps ``.grad`` an ordinary tensor that the optimizer's
``zero_grad(set_to_none=True)``, DTensor gradients and user code can replace freely.

Layout of a bucket buffer (one dtype, one device)::

    [ grad of p0 | grad of p1 | ... | grad of pk-1 | present(p0) ... present(pk-1) ]

The ``present`` tail holds 1 where this rank has a gradient for that parameter and 0 where it
has none (``grad is None``: unused in every backward since the last ``zero_grad``). After the
sum it tells whether ANY rank had a gradient: if none had, ``grad`` stays ``None`` everywhere,
exactly as in one process, so optimizers still skip the parameter.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["GradBucket", "all_reduce_buckets", "assign_buckets", "local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of ``tensor``: its local shard for a DTensor, itself otherwise.

    Writing into the result writes into ``tensor`` (for a DTensor, under ``no_grad``
    ``to_local()`` returns the local tensor object itself).
    """
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Split ``params`` (in the given order) into runs of consecutive indices of at most ``cap_bytes``.

    A new bucket starts when adding the next parameter would exceed the cap, or when its dtype
    or device differs (a flat buffer has one of each). A parameter larger than the cap gets a
    bucket of its own. Sizes are those of the rank-local tensors.
    """
    buckets: list[list[int]] = []
    size = 0
    key = None
    for index, param in enumerate(params):
        local = local_tensor(param)
        nbytes = local.numel() * local.element_size()
        param_key = (local.dtype, local.device)
        if not buckets or param_key != key or (size + nbytes > cap_bytes and size > 0):
            buckets.append([])
            size = 0
            key = param_key
        buckets[-1].append(index)
        size += nbytes
    return buckets


class GradBucket:
    """The gradients of a few parameters, packed into one flat buffer and all-reduced together.

    Use: ``write(i)`` for each parameter (or ``write_missing()``), ``launch(group)``, then
    ``finish(world_size)`` to wait, average and copy the result back into ``param.grad``.
    """

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        locals_ = [local_tensor(p) for p in self.params]
        self.dtype = locals_[0].dtype
        self.numels = [t.numel() for t in locals_]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]
        self.numel = sum(self.numels)
        self.buffer: torch.Tensor | None = None  # allocated on first use, then reused every step
        self.written = [False] * len(self.params)
        self.n_written = 0
        self.work: dist.Work | None = None

    def __len__(self) -> int:
        return len(self.params)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def complete(self) -> bool:
        """Every parameter's gradient has been written since the last ``finish``."""
        return self.n_written == len(self.params)

    def _buffer(self) -> torch.Tensor:
        # Device and dtype are read now, not when the bucket was built: a model replicated on the
        # meta device and then materialised (to_empty), or cast after apply_replicate, keeps these
        # same Parameter objects with new storage.
        first = local_tensor(self.params[0])
        if self.buffer is None or self.buffer.device != first.device or self.buffer.dtype != first.dtype:
            self.dtype = first.dtype
            self.buffer = torch.empty(self.numel + len(self.params), dtype=first.dtype, device=first.device)
        return self.buffer

    @torch.no_grad()
    def write(self, index: int) -> None:
        """Copy parameter ``index``'s current gradient into the buffer (zeros if it has none)."""
        buffer = self._buffer()
        param = self.params[index]
        start = self.offsets[index]
        view = buffer[start : start + self.numels[index]]
        if param.grad is None:
            view.zero_()
            buffer[self.numel + index] = 0
        else:
            view.copy_(local_tensor(param.grad).reshape(-1))
            buffer[self.numel + index] = 1
        if not self.written[index]:
            self.written[index] = True
            self.n_written += 1

    def write_missing(self) -> None:
        """Write every parameter not written yet (those whose gradient never became ready)."""
        for index, done in enumerate(self.written):
            if not done:
                self.write(index)

    def launch(self, group: dist.ProcessGroup | None) -> None:
        """Start the asynchronous sum over ``group``; every parameter must have been written."""
        if not self.complete:
            raise RuntimeError("GradBucket.launch: some gradients were not written (call write_missing first)")
        self.work = dist.all_reduce(self._buffer(), op=dist.ReduceOp.SUM, group=group, async_op=True)

    @torch.no_grad()
    def finish(self, world_size: int) -> None:
        """Wait for the sum, divide by ``world_size`` and copy each average into ``param.grad``.

        A parameter that no rank had a gradient for keeps ``grad = None``; one that this rank
        lacked but another had gets a gradient here, so all ranks leave with equal gradients.
        """
        if self.work is None:
            raise RuntimeError("GradBucket.finish called before launch")
        self.work.wait()
        self.work = None
        buffer = self._buffer()
        grads = buffer[: self.numel]
        # Reading the presence counts syncs a GPU: only do it when this rank lacks a gradient.
        lacking = any(p.grad is None for p in self.params)
        present = buffer[self.numel :].tolist() if lacking else [1] * len(self.params)
        for index, param in enumerate(self.params):
            if present[index] == 0:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            local = local_tensor(param.grad)
            start = self.offsets[index]
            # Average and copy back in one pass over memory.
            torch.div(grads[start : start + self.numels[index]].view(local.shape), world_size, out=local)
        self.reset()

    def reset(self) -> None:
        """Forget what was written so the next step starts clean. A collective still in flight
        (launched by a backward that raised) keeps the old buffer; the next write gets a new one."""
        if self.work is not None:
            self.buffer = None
        self.written = [False] * len(self.params)
        self.n_written = 0
        self.work = None


def all_reduce_buckets(
    buckets: Sequence[GradBucket], group: dist.ProcessGroup | None, world_size: int, launched: int = 0
) -> None:
    """Average every bucket's gradients over ``group``: launch ``buckets[launched:]`` (writing any
    gradient not written yet), then wait for all of them and copy the averages back."""
    for bucket in buckets[launched:]:
        bucket.write_missing()
        bucket.launch(group)
    for bucket in buckets:
        bucket.finish(world_size)
