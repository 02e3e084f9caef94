"""Stand-in values where the real step reads a number off a fake tensor.

A fake tensor has a shape and no data, so ``float(norm)``, ``bool(flags.any())`` or ``mask.nonzero()`` cannot
be answered. The training step reads such values for decisions that do not change what is allocated or sent in
a step that goes well (the gradient norm it prints, "is every gradient present on every rank", "is the loss
finite"). :class:`StandInValues` answers them as a healthy step would: a number 0 (a bool True: finite,
present), and no non-zero elements. An op whose inputs are all real tensors (the device mesh's rank tensors,
made before the fake mode) runs for real. Values torch kept on a fake tensor (a ``torch.tensor([...])`` literal) are
used as they are. Mixture-of-experts routing is a value that does change the memory: see
:mod:`ndparallel.dryrun.routing`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# TorchDispatchMode: the documented extension point for intercepting aten ops (a private module on 2.11-2.14).
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.dryrun.torch_api import fake_constant, is_fake, without_fake_mode

__all__ = ["StandInValues"]

_aten = torch.ops.aten


class StandInValues(TorchDispatchMode):
    """Answer ``item()``/``tolist()`` and ``nonzero()`` of fake tensors without values; count how often."""

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):  # torch names that class in no public module
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(is_fake(t) for t in tensors):
            # Only real inputs (the device mesh's rank tensors, made before the fake mode): computed for real.
            with without_fake_mode():
                return func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in (_aten._local_scalar_dense, _aten.nonzero) and _without_values(args[0]):
            self.answered += 1
            if packet is _aten.nonzero:
                return torch.empty((0, args[0].dim()), dtype=torch.int64, device=args[0].device)  # none set
            if args[0].dtype == torch.bool:
                return True
            return 0 if not args[0].dtype.is_floating_point else 0.0
        return func(*args, **kwargs)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _without_values(tensor: torch.Tensor) -> bool:
    return is_fake(tensor) and fake_constant(tensor) is None
