"""Data loaders for the Accelerator: shard a user's DataLoader over the ``dp`` view, move batches to the
device, flag the last batch (gradients sync there, as in Accelerate) and skip already-seen batches."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from ndparallel.errors import ConfigError

__all__ = ["EpochLoader", "shard_loader", "skip_first_batches", "to_device"]


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``batch`` with every tensor inside (dicts, lists, tuples, nested, objects with ``.to``) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


class EpochLoader(DataLoader):
    """A DataLoader over a DistributedSampler (``use_seedable_sampler=True``): advances the sampler's epoch on
    every pass (shuffling differs between epochs, the same on every rank), moves batches to ``device`` and tells
    ``gradient_state`` where it is (the last batch of a pass is known while the loop body runs on it)."""

    def __init__(self, *args: Any, device: torch.device | None, gradient_state: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._device = device
        self.gradient_state = gradient_state
        self._epoch = 0
        self.end_of_dataloader = False
        self.remainder = -1

    def _next_epoch(self) -> None:
        self.sampler.set_epoch(self._epoch)
        self._epoch += 1

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self._next_epoch()
        return self._flagged(super().__iter__())

    def _flagged(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Yield ``batches`` one ahead, so the last one is known while the loop body runs on it."""
        self.end_of_dataloader = False
        self.gradient_state.add_loader(self)
        try:
            current = next(batches, _END)
            while current is not _END:
                upcoming = next(batches, _END)
                self.end_of_dataloader = upcoming is _END
                yield self._placed(current)
                current = upcoming
        finally:
            self.gradient_state.remove_loader(self)

    def _placed(self, batch: Any) -> Any:
        return batch if self._device is None else to_device(batch, self._device)


_END = object()


def shard_loader(
    loader: DataLoader,
    dp_size: int,
    dp_rank: int,
    device: torch.device | None,
    gradient_state: Any,
    seed: int = 0,
    split_batches: bool = False,
) -> EpochLoader:
    """``loader`` rebuilt over a DistributedSampler on the dp view: rank ``r`` gets samples ``r, r + dp, ...``
    of each pass (``drop_last``: every rank the same number of batches), ``batch_size`` samples per batch
    (``split_batches``: ``batch_size / dp``, so that one step's batches together are the loader's batch)."""
    if isinstance(loader.sampler, DistributedSampler) or loader.batch_size is None:
        raise ConfigError(
            "prepare() shards a DataLoader built with batch_size= and no DistributedSampler; "
            "shard your own loader by accelerator.mesh.local_rank('dp') instead"
        )
    if split_batches and loader.batch_size % dp_size:
        raise ConfigError(
            f"split_batches=True splits each batch over the {dp_size} data ranks, but the batch size is "
            f"{loader.batch_size}; use a batch size divisible by {dp_size}"
        )
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=not isinstance(loader.sampler, SequentialSampler),
        seed=seed,
        drop_last=True,
    )
    options = {}
    if loader.num_workers > 0:
        options = dict(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
    return EpochLoader(
        loader.dataset,
        batch_size=loader.batch_size // dp_size if split_batches else loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        device=device,
        gradient_state=gradient_state,
        **options,
    )


class _SkipBatches:
    """Batch indices of ``batch_sampler`` minus the first ``count`` (no sample of a skipped batch is loaded)."""

    def __init__(self, batch_sampler: Any, count: int):
        self.batch_sampler = batch_sampler
        self.count = count

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.count, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.count)


class _SkippedEpoch(EpochLoader):
    """One pass of an :class:`EpochLoader` without its first batches; the original loader's epoch advances."""

    def __init__(self, original: EpochLoader, count: int):
        batches = _SkipBatches(BatchSampler(original.sampler, original.batch_size, original.drop_last), count)
        DataLoader.__init__(
            self,
            original.dataset,
            batch_sampler=batches,
            num_workers=original.num_workers,
            collate_fn=original.collate_fn,
            pin_memory=original.pin_memory,
            timeout=original.timeout,
            worker_init_fn=original.worker_init_fn,
            generator=original.generator,
        )
        self._original = original
        self._device = original._device
        self.gradient_state = original.gradient_state
        self.end_of_dataloader, self.remainder = False, -1

    def _next_epoch(self) -> None:
        self._original._next_epoch()


def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
    """A loader that yields what ``loader``'s next pass would, minus its first ``num_batches`` batches (for
    resuming inside an epoch); later passes use ``loader`` itself. Batch samplers skip without loading."""
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ConfigError(f"skip_first_batches: num_batches={num_batches!r} must be an integer >= 0")
    if isinstance(loader, EpochLoader):
        return _SkippedEpoch(loader, num_batches)
    if isinstance(loader, DataLoader) and loader.batch_sampler is not None:
        return DataLoader(
            loader.dataset,
            batch_sampler=_SkipBatches(loader.batch_sampler, num_batches),
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
        )
    return _Skipped(loader, num_batches)


class _Skipped:
    """Any iterable without its first ``count`` items (they are produced, then dropped)."""

    def __init__(self, iterable: Any, count: int):
        self.iterable = iterable
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.iterable), self.count, None)
