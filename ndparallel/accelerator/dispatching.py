"""Accelerate's dispatched loader for a DataLoader over an ``IterableDataset`` (its default for streams): only the
first process reads the stream. Each step it reads one batch per data rank, concatenates them and broadcasts the
result; every rank keeps its slice. At the end of the stream the last, shorter step is split evenly, completed
with the first samples of the pass when the ranks do not divide it (``gather_for_metrics`` drops them again).
The loader's ``drop_last`` drops that last step instead. Iterable datasets over a mesh with tp or cp are refused
(Accelerate refuses them too)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ndparallel.accelerator.data import to_device
from ndparallel.accelerator.misc import get_data_structure, initialize_tensors
from ndparallel.accelerator.operations import broadcast, broadcast_object_list, concatenate, find_batch_size
from ndparallel.accelerator.operations import recursively_apply as _apply

__all__ = ["DispatchedLoader"]


def _slice(batch: Any, index: slice) -> Any:
    return _apply(lambda t: t[index], batch)


class DispatchedLoader(DataLoader):
    """The loader ``prepare()`` makes of a DataLoader over an IterableDataset (module doc)."""

    def __init__(self, dataset: Any, *, gradient_state: Any, device: torch.device | None, ranks: int, rank: int,
                 original_drop_last: bool, non_blocking: bool = False, **options: Any):  # fmt: skip
        super().__init__(dataset, **options)
        self.gradient_state, self.device = gradient_state, device
        self.ranks, self.rank = ranks, rank
        self._drop_last, self._non_blocking = original_drop_last, non_blocking
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1

    @property
    def total_batch_size(self) -> int:
        return (self.batch_size or 1) * self.ranks

    def __len__(self) -> int:
        whole = super().__len__()
        return whole // self.ranks if self._drop_last else -(-whole // self.ranks)

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _fetch(self, source: Iterator[Any], stopped: bool) -> tuple[Any, list, bool]:
        """The next step's batch on the first rank (``None`` elsewhere), what it looks like, and whether the
        stream has ended; every rank learns the last two."""
        batch, batches, info = None, [], [None, stopped]
        if self.rank == 0:
            try:
                for _ in range(self.ranks):
                    batches.append(next(source))
                batch = concatenate(batches, dim=0)
                info = [get_data_structure(batch), False]
            except StopIteration:
                info = [None, True]
        broadcast_object_list(info)
        stopped = info[1]
        if stopped and not self._drop_last:  # a partial last step: what the first rank did read
            info = [None, True]
            if self.rank == 0 and batches:
                batch = concatenate(batches, dim=0)
                info = [get_data_structure(batch), False]
            broadcast_object_list(info)
        return batch, info, stopped

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader, self.remainder = False, -1
        self.gradient_state.add_loader(self)
        try:
            self.set_epoch(self.iteration)
            source = super().__iter__()
            first = None
            batch, info, stopped = self._fetch(source, False)
            done = False
            while not done:
                if self.rank != 0:
                    batch = initialize_tensors(info[0])
                batch = to_device(batch, self.device, self._non_blocking) if self.device is not None else batch
                if dist.is_initialized() and dist.get_world_size() > 1:
                    batch = broadcast(batch, from_process=0)
                if not self._drop_last and first is None:
                    first = _slice(batch, slice(0, self.ranks))
                observed = find_batch_size(batch)
                size = observed // self.ranks
                done = stopped
                if not done:
                    upcoming, upcoming_info, stopped = self._fetch(source, stopped)
                    done = stopped and upcoming_info[0] is None
                if not self._drop_last and done and observed % self.ranks:
                    batch, size = concatenate([batch, first], dim=0), size + 1
                mine = _slice(batch, slice(self.rank * size, (self.rank + 1) * size))
                if done:
                    self.end_of_dataloader, self.remainder = True, observed
                yield mine
                if not done:
                    batch, info = upcoming, upcoming_info
            self.iteration += 1
        finally:
            self.gradient_state.remove_loader(self)
