"""Values where the real step reads a number: small tensors stay real, routing is balanced, the rest stands in.

A fake tensor has a shape and no data, so ``float(norm)``, ``bool(flags.any())`` or ``mask.nonzero()`` cannot
be answered. The training step reads such values for its control flow: how many parameters every rank holds,
which ranks lack a gradient, how many tokens each expert gets. :class:`DryRunValues` keeps that flow as in a
healthy step of a job whose ranks are alike:

- small tensors are real: an op on real tensors only (the device mesh's rank tensors, a ``torch.tensor([...])``
  of flags) runs for real, and ``torch.zeros`` / ``ones`` / ``full`` of at most ``SMALL`` integers
  or bools make a real tensor; the model's tensors, made from fake parameters and inputs, stay fake;
- a collective over real tensors on the fake process group returns this rank's own values, as if every rank
  held the same (an all-gather repeats them, an all-to-all sends them back); so does ``all_gather_object``
  (:func:`objects_as_if_every_rank_alike`: its pickles travel in byte tensors, which fake tensors cannot carry);
- routing is balanced: ``torch.bincount`` of fake expert indices counts the same tokens for every expert
  (remainders to the first), as a real tensor (the mixture-of-experts dispatch splits rows by it);
- any other value read off a fake tensor stands in as a healthy step's: 0 (a bool True: finite, present), and
  no non-zero elements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.distributed.local_ops import LocalOpMode
from ndparallel.dryrun.torch_api import is_fake, tensors_in, without_fake_mode

__all__ = ["SMALL", "DryRunValues", "objects_as_if_every_rank_alike"]

SMALL = 1 << 16
"""Elements of the largest factory tensor kept real (512 KiB in float64): control-flow tensors are far smaller,
a model's activations and buffers far larger."""

_aten, _c10d = torch.ops.aten, torch.ops.c10d
_STAND_IN = (_aten._local_scalar_dense, _aten.nonzero)
_CONTROL_FACTORIES = (_aten.zeros, _aten.ones, _aten.full, _aten.scalar_tensor)
"""The factories a control-flow tensor comes from (not ``empty``, ``arange`` or ``randint``: buffers, positions and
tokens are data, which context parallelism shards in place into fake tensors)."""


class DryRunValues(LocalOpMode):
    """The values of a dry run (see the module docstring); ``stood_in``: how many values had no source."""

    def __init__(self) -> None:
        super().__init__()
        self.stood_in = 0

    def local_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensors = tensors_in((args, kwargs))
        fake = [t for t in tensors if is_fake(t)]
        packet = func.overloadpacket
        if not fake:
            return self._real(func, packet, tensors, args, kwargs)
        if packet is _aten.bincount:
            return _balanced_counts(args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0))
        if packet in _STAND_IN:
            self.stood_in += 1
            if packet is _aten.nonzero:
                return torch.empty((0, args[0].dim()), dtype=torch.int64, device=args[0].device)  # none set
            if args[0].dtype == torch.bool:
                return True
            return 0 if not args[0].dtype.is_floating_point else 0.0
        return func(*args, **kwargs)

    @staticmethod
    def _real(func, packet, tensors: list[torch.Tensor], args, kwargs):  # noqa: ANN001
        if tensors:  # real inputs only: computed for real
            with without_fake_mode():
                out = func(*args, **kwargs)
            _as_if_every_rank_alike(packet, args)
            return out
        out = func(*args, **kwargs)  # a factory: fake, unless a small integer tensor (never a float: DTensor's
        # sharding propagation makes float and index tensors to run ops on them fake, and a real float input
        # beside a real index would run for real on uninitialised indices)
        small = isinstance(out, torch.Tensor) and out.numel() <= SMALL and not out.is_floating_point()
        if small and packet in _CONTROL_FACTORIES:
            with without_fake_mode():
                return func(*args, **kwargs)
        return out


def _as_if_every_rank_alike(packet: Any, args: tuple) -> None:
    """After a c10d collective over real tensors on the fake process group (which writes nothing): the result
    every rank would get if all held this rank's values."""
    with without_fake_mode(), torch.no_grad():
        if packet is _c10d.allgather_:  # [[output per rank]], [input]
            for outputs, inp in zip(args[0], args[1], strict=True):
                for out in outputs:
                    out.copy_(inp)
        elif packet in (_c10d._allgather_base_, _c10d.allgather_into_tensor_coalesced_):
            out, inp = args[0], args[1]
            for o, i in zip(_tensor_list(out), _tensor_list(inp), strict=True):
                o.copy_(i.reshape(-1).repeat(o.numel() // max(1, i.numel())).view_as(o))
        elif packet is _c10d.alltoall_base_:
            args[0].copy_(args[1])


@contextlib.contextmanager
def objects_as_if_every_rank_alike() -> Iterator[None]:
    """While entered, ``torch.distributed.all_gather_object`` fills every slot with this rank's object (the
    pipeline's per-stage router loads are the one object collective of a training step). A public torch
    function replaced for the dry run only: the pickles it sends cannot cross fake tensors."""
    original = dist.all_gather_object

    def all_gather_object(object_list: list, obj: Any, group: Any = None) -> None:
        object_list[:] = [obj] * dist.get_world_size(group)

    dist.all_gather_object = all_gather_object
    try:
        yield
    finally:
        dist.all_gather_object = original


def _tensor_list(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _balanced_counts(indices: torch.Tensor, minlength: int) -> torch.Tensor:
    """``bincount(indices, minlength)`` of a balanced router: equal counts, the remainder to the first bins."""
    bins = max(int(minlength), 1)
    total = indices.numel()
    counts = [total // bins + (1 if b < total % bins else 0) for b in range(bins)]
    with without_fake_mode():
        return torch.tensor(counts, dtype=torch.int64, device=indices.device.type)
