"""Peak live tensor memory of one rank on CPU, where torch keeps no allocator statistics.

``LiveMemory`` is a ``TorchDispatchMode``: every tensor an aten op reads or writes (and every
tensor handed in as a root: parameters, optimizer state) has its *storage* remembered through a
weak reference. After each op the mode sums the current ``nbytes()`` of the storages still alive;
the maximum of that sum is the peak. Storages are counted once however many views share them, a
storage that is freed drops out (its weak reference dies), and a storage that FSDP2 resizes to 0
after resharding counts 0 from then on, because sizes are read at each sample, not at allocation.

What it does not see: memory that is not a torch tensor (gloo's internal buffers, Python objects)
and temporaries that live only inside one op (e.g. inside a DTensor redistribution). So the figure
is "live tensor bytes", a floor on the process's real footprint, comparable across mesh shapes.
On CUDA use ``torch.cuda.max_memory_allocated`` instead (the harness does).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

# TorchDispatchMode lives in a private module on every torch version (2.11-2.14), but it is the
# documented extension point for intercepting aten ops (CommDebugMode and FlopCounterMode build on it).
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.distributed.local_ops import local_shard

__all__ = ["LiveMemory", "state_bytes"]


def _storage(tensor: Any) -> torch.UntypedStorage | None:
    if not isinstance(tensor, torch.Tensor):
        return None
    tensor = local_shard(tensor)
    if tensor.device.type == "meta" or tensor.is_sparse:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
        return None


def _tensors(value: Any) -> Iterable[Any]:
    """Leaves of nested lists / tuples / dicts (an op's args, kwargs or outputs)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    else:
        yield value


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _storage(tensor)
        if storage is not None:
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


class LiveMemory(TorchDispatchMode):
    """Track live tensor storage bytes while active; ``peak_bytes`` is the maximum seen.

    ``roots``: tensors alive before the mode starts that ops may not touch at once (parameters,
    gradients, optimizer state); they count from the first sample.
    """

    def __init__(self, roots: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        self.peak_bytes = 0
        self.start_bytes = 0
        for tensor in roots:
            self._track(tensor)
        self.start_bytes = self.live_bytes()
        self.peak_bytes = self.start_bytes

    def _track(self, tensor: Any) -> None:
        storage = _storage(tensor)
        if storage is None:
            return
        key = id(storage)
        if key not in self._storages:
            # The storage's Python object lives exactly as long as the storage (torch preserves it),
            # so the callback removes the entry when the memory is freed and ids are not reused stale.
            self._storages[key] = weakref.ref(storage, lambda _ref, k=key: self._storages.pop(k, None))

    def live_bytes(self) -> int:
        """Current bytes of every tracked storage that is still alive."""
        total = 0
        for ref in list(self._storages.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        for tensor in _tensors((args, kwargs)):
            self._track(tensor)
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            self._track(tensor)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out
