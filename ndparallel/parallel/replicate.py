"""Pure data parallel: every rank holds the whole model; gradients are averaged over the dp group.

``apply_replicate(model, dp_mesh)`` makes the ranks of ``dp_mesh`` start from identical
parameters (broadcast from the group's first rank) and registers one post-accumulate-grad hook
per parameter. In backward each hook copies its gradient into a size-capped bucket; as soon as
a bucket is full (and every bucket before it has gone) it is all-reduced asynchronously, while
autograd keeps computing the gradients of earlier layers. When the backward pass ends, the
remaining buckets go out, every collective is awaited and the averages are copied back::

    model = apply_replicate(model, mesh["dp_replicate"], bucket_mb=25)
    for micro_batch in batches[:-1]:
        with no_sync(model):                      # accumulate locally, no communication
            (loss_fn(model(micro_batch)) / len(batches)).backward()
    (loss_fn(model(batches[-1])) / len(batches)).backward()   # all-reduces the accumulated sum
    opt.step()

Buckets are filled in reverse registration order (about the order gradients become ready) and
launched strictly in bucket order, so every rank issues the same collectives in the same order
whatever its timing. A parameter whose gradient never became ready (unused in this forward) is
sent with its current gradient, or zeros and a "no gradient" mark, when backward ends; no
``find_unused_parameters`` flag is needed, and one that no rank used keeps ``grad = None``.
DTensor parameters (tensor parallel inside each replica) are all-reduced through their local
shards over the dp group only. See docs/data-parallel.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ndparallel.distributed.buckets import GradBucket, all_reduce_buckets, assign_buckets, local_tensor
from ndparallel.errors import ConfigError

__all__ = ["ReplicateState", "apply_replicate", "no_sync", "replicate_state"]

_STATE_ATTR = "_ndp_replicate"


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, bucket_mb: float = 25.0) -> nn.Module:
    """Data-parallel ``model`` over the 1-D ``dp_mesh``; returns the same module (FQNs unchanged).

    ``bucket_mb`` caps each all-reduce bucket (MiB of rank-local gradient). Parameters that do
    not require grad at this call are left out of gradient averaging (still broadcast).
    """
    _check_bucket_mb(bucket_mb)
    if not isinstance(dp_mesh, DeviceMesh) or dp_mesh.ndim != 1:
        raise ConfigError(
            f"apply_replicate needs a 1-D DeviceMesh for the data-parallel group, got {dp_mesh!r}; "
            'pass mesh["dp_replicate"]'
        )
    if hasattr(model, _STATE_ATTR):
        raise ConfigError(f"{type(model).__name__} is already replicated: call apply_replicate once per model")
    _check_not_sharded_over(model, dp_mesh)
    group = dp_mesh.get_group()
    _broadcast_from_first_rank(model, group)
    params = [p for p in model.parameters() if p.requires_grad]
    state = ReplicateState(params, group, int(bucket_mb * 2**20))
    setattr(model, _STATE_ATTR, state)
    if state.world_size > 1:
        state.forward_hook = model.register_forward_pre_hook(state.on_forward)
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Inside this context backward only accumulates gradients locally (no communication).

    The first backward after the context all-reduces the accumulated gradients. With the loss
    divided by the number of micro-batches, the result is the average over micro-batches x ranks.
    """
    state = replicate_state(model)
    previous, state.sync = state.sync, False
    try:
        yield
    finally:
        state.sync = previous


def replicate_state(model: nn.Module) -> ReplicateState:
    """The bucket and hook state ``apply_replicate`` attached to ``model``."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ConfigError(f"{type(model).__name__} is not replicated: call apply_replicate(model, dp_mesh) first")
    return state


class ReplicateState:
    """Buckets, hooks and the per-backward bookkeeping of one replicated model."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, cap_bytes: int):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.cap_bytes = cap_bytes
        self.sync = True  # False inside no_sync
        self.hooks: list[RemovableHandle] = []
        self.forward_hook: RemovableHandle | None = None
        self._bind(params)

    def _bind(self, params: list[nn.Parameter]) -> None:
        """(Re)build buckets and gradient hooks for ``params``."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        self.params = params
        order = params[::-1]  # reverse registration order ~ the order gradients become ready
        self.buckets = [GradBucket([order[i] for i in idx]) for idx in assign_buckets(order, self.cap_bytes)]
        self._next_launch = 0  # buckets [0, _next_launch) have been launched this backward
        self._in_backward = False
        if self.world_size > 1:
            for b, bucket in enumerate(self.buckets):
                for i, param in enumerate(bucket.params):
                    hook = functools.partial(self._on_grad_ready, b, i)
                    self.hooks.append(param.register_post_accumulate_grad_hook(hook))

    def _on_grad_ready(self, bucket_index: int, param_index: int, _param: torch.Tensor) -> None:
        if not self.sync:
            return
        if not self._in_backward:
            self._in_backward = True
            _queue_end_of_backward(self._end_of_backward)
        self.buckets[bucket_index].write(param_index)
        # Launch in bucket order only: all ranks then issue identical collective sequences.
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self.buckets[self._next_launch].launch(self.group)
            self._next_launch += 1

    def on_forward(self, module: nn.Module, _args: tuple) -> None:
        """A new forward. If the module's parameters are no longer the objects the hooks sit on
        (``to_empty`` after building on the meta device, a move to another device), rebind them.
        Else forget a backward pass that ended without its callback (it raised), so this step's
        backward queues a fresh one instead of silently skipping the average."""
        current = [p for p in module.parameters() if p.requires_grad]
        if len(current) != len(self.params) or any(a is not b for a, b in zip(current, self.params, strict=True)):
            self._bind(current)
        elif self._in_backward:
            self._next_launch, self._in_backward = 0, False
            for bucket in self.buckets:
                bucket.reset()

    def _end_of_backward(self) -> None:
        launched, self._next_launch, self._in_backward = self._next_launch, 0, False
        try:
            all_reduce_buckets(self.buckets, self.group, self.world_size, launched=launched)
        finally:
            for bucket in self.buckets:
                bucket.reset()

    def remove(self) -> None:
        """Remove the gradient hooks (the model stops averaging gradients)."""
        for handle in [*self.hooks, *([self.forward_hook] if self.forward_hook else [])]:
            handle.remove()
        self.hooks.clear()
        self.forward_hook = None


def _queue_end_of_backward(callback: Callable[[], None]) -> None:
    # Private torch API, isolated here: autograd has no public "call this when the current
    # backward pass has finished" hook (torch DDP and FSDP2 use this same call; it exists in
    # torch 2.11-2.14). Public hooks do not fit: a hook on the output fires when backward
    # starts, and torch.autograd.graph.register_multi_grad_hook fires before the last
    # gradient has been accumulated into .grad. Must be called while backward runs.
    Variable._execution_engine.queue_callback(callback)


def _check_bucket_mb(bucket_mb: object) -> None:
    ok = isinstance(bucket_mb, (int, float)) and not isinstance(bucket_mb, bool)
    if not ok or not math.isfinite(bucket_mb) or bucket_mb <= 0:
        raise ConfigError(f"bucket_mb={bucket_mb!r} must be a positive number of megabytes (e.g. dp_bucket_mb=25)")


def _check_not_sharded_over(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    dim = (dp_mesh.mesh_dim_names or (None,))[0]
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and dim is not None and dim in (param.device_mesh.mesh_dim_names or ()):
            raise ConfigError(
                f"parameter {name!r} is already a DTensor over mesh dim {dim!r}: apply_replicate needs "
                "parameters that are whole on each replica (use fully_shard with an HSDP mesh instead)"
            )


@torch.no_grad()
def _broadcast_from_first_rank(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every rank's parameters and buffers equal to those of the group's first rank.

    Tensors on the meta device have no values yet: whoever materialises them (``to_empty`` + a
    seeded init, or a checkpoint load) must make them equal on every rank.
    """
    if dist.get_world_size(group) == 1:
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        local = local_tensor(tensor).detach()
        if local.is_meta:
            continue
        if local.dtype == torch.bool:
            local = local.view(torch.uint8)
        staging = local if local.is_contiguous() else local.contiguous()
        dist.broadcast(staging, group=group, group_src=0)
        if staging is not local:
            local.copy_(staging)
