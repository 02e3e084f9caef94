"""A torch dispatch mode over the ops that run on this rank's plain tensors (:class:`LocalOpMode`).

What the collective counter and the dry run's tracker and value stand-ins share: a higher-order operator
(DTensor's random ops, checkpointing's wrappers) runs as it is, and a DTensor op desugars first, so its local
ops and the collectives it issues come back through the mode on plain tensors. A subclass sees only those.
``local_shard`` reads a DTensor's shard from inside such a mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

# TorchDispatchMode, the documented extension point for intercepting aten ops, lives in a private module on
# torch 2.11-2.14.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LocalOpMode", "local_shard"]

_METADATA_QUERIES = frozenset({torch.ops.prim.device.default})
"""Ops that only read a tensor's metadata (the autograd engine asks each gradient's device): passed on untouched.
Nothing a subclass counts, and in a dry run about three of every four ops (docs/benchmarks.md, dry run)."""


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local elements (any other tensor itself), without going through autograd or dispatch."""
    # DTensor keeps its shard in ``_local_tensor``; ``to_local()`` is an autograd op and would be dispatched
    # again from inside a dispatch mode (and costs ~45x more per call), so read the attribute (stable on torch
    # 2.11-2.14).
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _is_higher_order(func: Any) -> bool:
    # torch names the class of higher-order operators in no public module (torch._ops)
    return isinstance(func, torch._ops.HigherOrderOperator)


class LocalOpMode(TorchDispatchMode):
    """Override :meth:`local_op`: called for every op on plain (possibly fake) tensors, as ``func(*args,
    **kwargs)`` would be; it returns the op's result."""

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True  # passed on untouched below

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if _is_higher_order(func) or func in _METADATA_QUERIES:
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars: its local ops come back here
        return self.local_op(func, args, kwargs)

    def local_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError
