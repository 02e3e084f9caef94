"""Accelerate's data semantics for a prepared DataLoader (the default; docs/accelerate-migration.md, "Data").

The loader keeps its own sampler and batch sampler. Whole batches are dealt round-robin to the data-parallel
ranks: on 2 ranks, rank 0 gets batches 0, 2, 4 ... and rank 1 batches 1, 3, 5 ... of each pass
(``split_batches=True`` gives each rank a slice of every batch instead). A shuffling sampler draws its order
from a generator that rank 0's state overwrites on every rank at the start of each pass, so all ranks deal
from one order. The last round of a pass:

- ``drop_last`` (the loader's): a round that does not give every rank a full batch is dropped;
- ``even_batches=True`` (the default): it is completed with the first samples of the pass, so every rank
  gets as many full batches (``gather_for_metrics`` then drops the repeated samples);
- ``even_batches=False``: the ranks that have a batch get it, the others stop one batch early.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ndparallel.accelerator import data
from ndparallel.accelerator.data import to_device
from ndparallel.errors import ConfigError

__all__ = [
    "DealtBatches",
    "DealtLoader",
    "check_rng_types",
    "deal_loader",
    "loader_options",
    "skip_first_batches",
    "sync_rng",
]


class DealtBatches(BatchSampler):
    """The batches of ``batches`` (a batch sampler) that data rank ``rank`` of ``ranks`` gets (module doc)."""

    def __init__(self, batches: Any, ranks: int, rank: int, split_batches: bool = False, even_batches: bool = True):
        self.batch_sampler = batches
        self.num_processes, self.process_index = ranks, rank
        self.split_batches, self.even_batches = split_batches, even_batches
        self.batch_size = getattr(batches, "batch_size", None)
        self.drop_last = getattr(batches, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % ranks):
            raise ConfigError(
                f"split_batches=True splits each batch over the {ranks} data ranks, but the batch size is "
                f"{self.batch_size}; use a batch size divisible by {ranks}"
            )

    def __len__(self) -> int:
        total = len(self.batch_sampler)
        if self.split_batches:
            return total
        rounds, left = divmod(total, self.num_processes)
        if left == 0 or self.drop_last:
            return rounds
        return rounds + 1 if self.even_batches or self.process_index < left else rounds

    def __iter__(self) -> Iterator[list[int]]:
        return self._slices() if self.split_batches else self._whole_batches()

    def _full(self, batch: list) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    def _whole_batches(self) -> Iterator[list]:
        ranks, rank = self.num_processes, self.process_index
        head: list = []  # the first `ranks` batches of the pass, to complete the last round
        round_: list = []
        for index, batch in enumerate(self.batch_sampler):
            if not self.drop_last and index < ranks:
                head += [batch] if self.batch_size is None else list(batch)
            round_.append(batch)
            if len(round_) == ranks and self._full(batch):
                yield round_[rank]
                round_ = []
        if self.drop_last or not head or not round_:
            return
        if not self.even_batches:
            if rank < len(round_):
                yield round_[rank]
            return
        yield from self._completed_round(round_, head)

    def _completed_round(self, round_: list, head: list) -> Iterator[list]:
        """This rank's batch of the unfinished last round, completed from ``head`` (repeated if the pass is short)."""
        ranks, rank = self.num_processes, self.process_index
        if rank < len(round_) and self._full(round_[rank]):
            yield round_[rank]
        needed = ranks if self.batch_size is None else ranks * self.batch_size
        while len(head) < needed:
            head = head + head
        partial = [] if self._full(round_[-1]) else list(round_[-1])
        slot = len(round_) if not partial else len(round_) - 1
        used = 0
        while slot % ranks or partial:
            if self.batch_size is None:
                batch, used = head[used], used + 1
            else:
                take = self.batch_size - len(partial)
                batch, used = partial + head[used : used + take], used + take
            if slot % ranks == rank:
                yield batch
            partial, slot = [], slot + 1

    def _slices(self) -> Iterator[list]:
        width = self.batch_size // self.num_processes
        start = width * self.process_index
        first: list = []
        last: list = []
        for index, batch in enumerate(self.batch_sampler):
            first = list(batch) if index == 0 else first
            last = list(batch)
            if len(batch) == self.batch_size:
                yield batch[start : start + width]
        if self.drop_last or not first or len(last) == self.batch_size:
            return
        if not self.even_batches:
            if len(last) > start:
                yield last[start : start + width]
            return
        while len(first) < self.batch_size:
            first = first + first
        yield (last + first)[start : start + width]


RNG_TYPES = ("generator", "torch", "cuda")


def check_rng_types(rng_types: Any) -> list[str]:
    """``Accelerator(rng_types=)``: which generators each prepared loader's pass copies from rank 0 (default: the
    loader's sampler generator only, as Accelerate's)."""
    names = ["generator"] if rng_types is None else [getattr(r, "value", r) for r in rng_types]
    unknown = [n for n in names if n not in RNG_TYPES]
    if unknown:
        raise ConfigError(f"rng_types={unknown!r} is not supported by ndparallel: use {list(RNG_TYPES)}")
    return names


def _broadcast_state(state: torch.Tensor) -> torch.Tensor:
    dist.broadcast(state, src=0)
    return state


def sync_rng(rng_types: list[str], generator: torch.Generator | None) -> None:
    """Overwrite the named generators' states with rank 0's on every rank (one broadcast over the world each)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for name in rng_types:
        if name == "generator" and generator is not None:
            generator.set_state(_broadcast_state(generator.get_state()))
        elif name == "torch":
            torch.set_rng_state(_broadcast_state(torch.get_rng_state()))
        elif name == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(_broadcast_state(torch.cuda.get_rng_state().cuda()).cpu())


class DealtLoader(DataLoader):
    """A DataLoader over :class:`DealtBatches` (or the user's loader unchanged in one process): syncs the
    shuffling generator at each pass, places batches on ``device``, sets the sampler's epoch, and tells the
    Accelerator's gradient state where it is (the last batch is known while it is being used)."""

    def __init__(self, dataset: Any, *, gradient_state: Any, device: torch.device | None, rng_types: list[str],
                 generator_to_sync=None, non_blocking: bool = False, original_drop_last: bool = False,
                 total_batch_size: int = 1, **options):  # fmt: skip
        super().__init__(dataset, **options)
        self.gradient_state = gradient_state
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = generator_to_sync
        self._non_blocking = non_blocking
        self._drop_last = original_drop_last
        self._total_batch_size = total_batch_size
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all data ranks (the loader's batch size x data ranks, or it alone when split)."""
        return self._total_batch_size

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """The pass number the sampler (if it has ``set_epoch``) shuffles for, as Accelerate's loader."""
        self.iteration = epoch
        for holder in (self.batch_sampler, getattr(self.batch_sampler, "batch_sampler", None)):
            sampler = getattr(holder, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
                return
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _begin(self) -> None:
        self.end_of_dataloader, self.remainder = False, -1
        if not self._drop_last:
            try:
                self.remainder = len(self.dataset) % self.total_batch_size
            except TypeError:
                pass
        self.gradient_state.add_loader(self)

    def __iter__(self) -> Iterator[Any]:
        sync_rng(self.rng_types, self.synchronized_generator)
        self._begin()
        self.set_epoch(self.iteration)
        try:
            batches = super().__iter__()
            current = next(batches, _END)
            while current is not _END:
                upcoming = next(batches, _END)
                self.end_of_dataloader = upcoming is _END
                yield current if self.device is None else to_device(current, self.device, self._non_blocking)
                current = upcoming
            self.iteration += 1
        finally:
            self.gradient_state.remove_loader(self)


_END = object()

# DataLoader keywords copied from the user's loader (the batching ones are replaced by the dealt batch sampler).
_COPIED = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
    "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)  # fmt: skip


def loader_options(loader: DataLoader) -> dict[str, Any]:
    """The keywords that rebuild ``loader`` around another batch sampler."""
    options = {name: getattr(loader, name) for name in _COPIED if hasattr(loader, name)}
    if loader.num_workers == 0:  # DataLoader refuses these without workers
        options.pop("prefetch_factor", None)
        options["persistent_workers"] = False
    if options.get("multiprocessing_context") is None:
        options.pop("multiprocessing_context", None)
    return options


def deal_loader(loader: DataLoader, ranks: int, rank: int, gradient_state: Any, device: torch.device | None,
                config: Any, rng_types: list[str]) -> DealtLoader:  # fmt: skip
    """``loader`` rebuilt as Accelerate's ``prepare`` does (``config``: a DataLoaderConfiguration; module doc)."""
    if isinstance(loader.dataset, IterableDataset):
        return _dispatch(loader, ranks, rank, gradient_state, device, config)
    if config.dispatch_batches:
        raise ConfigError(
            "dispatch_batches=True for a map-style dataset: every rank reads its own batches from its own copy of "
            "the loader here; set dispatch_batches=None"
        )
    batches = loader.batch_sampler
    if batches is None:
        raise ConfigError(
            "prepare() of a DataLoader without batches (batch_size=None): build it with batch_size= or batch_sampler="
        )
    generator = None
    if ranks > 1:
        sampler = getattr(batches, "sampler", None)
        if sampler is not None and hasattr(sampler, "generator"):
            if sampler.generator is None:  # Accelerate's seed: one draw of the global torch generator
                sampler.generator = torch.Generator()
                sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            generator = sampler.generator
        batches = DealtBatches(batches, ranks, rank, config.split_batches, config.even_batches)
    batch_size = getattr(loader.batch_sampler, "batch_size", None) or 1
    return DealtLoader(
        loader.dataset,
        batch_sampler=batches,
        gradient_state=gradient_state,
        device=device,
        rng_types=[n for n in rng_types if n != "generator" or generator is not None],
        generator_to_sync=generator,
        non_blocking=config.non_blocking,
        original_drop_last=loader.drop_last,
        total_batch_size=batch_size if config.split_batches else batch_size * ranks,
        **loader_options(loader),
    )


def _dispatch(loader: DataLoader, ranks: int, rank: int, gradient_state: Any, device: torch.device | None,
              config: Any) -> Any:  # fmt: skip
    """An IterableDataset's loader: the first rank reads, every rank gets its slice (dispatching.py)."""
    from ndparallel.accelerator.dispatching import DispatchedLoader

    if config.dispatch_batches is False or config.split_batches:
        setting = "dispatch_batches=False" if config.dispatch_batches is False else "split_batches=True"
        raise ConfigError(
            f"{setting} with an IterableDataset is not supported by ndparallel: its stream is read by the first rank "
            "and dispatched; keep dispatch_batches=None and split_batches=False"
        )
    if dist.is_initialized() and ranks != dist.get_world_size():
        raise ConfigError(
            "an IterableDataset under tp or cp: its dispatched batches would reach every rank of a tp/cp group "
            "apart; give the loader a map-style dataset (Accelerate refuses this too)"
        )
    options = loader_options(loader)
    options.pop("generator", None)  # as Accelerate's dispatcher: the stream's own order
    return DispatchedLoader(
        loader.dataset, gradient_state=gradient_state, device=device, ranks=ranks, rank=rank,
        original_drop_last=loader.drop_last, non_blocking=config.non_blocking, batch_size=loader.batch_size,
        drop_last=loader.drop_last, **options,
    )  # fmt: skip


class _SkippedBatches(BatchSampler):
    """A batch sampler without its first ``count`` batches (no sample of a skipped batch is loaded)."""

    def __init__(self, batch_sampler: Any, count: int):
        self.batch_sampler, self.count = batch_sampler, count
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)

    def __iter__(self) -> Iterator[list]:
        return itertools.islice(iter(self.batch_sampler), self.count, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.count)


def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
    """A loader yielding what ``loader``'s next pass would, minus its first ``num_batches`` batches (resuming
    inside an epoch): for a prepared loader, one that syncs and places alike; later passes use ``loader``."""
    if not isinstance(loader, DealtLoader):
        return data.skip_first_batches(loader, num_batches)
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ConfigError(f"skip_first_batches: num_batches={num_batches!r} must be an integer >= 0")
    skipped = DealtLoader(
        loader.dataset,
        batch_sampler=_SkippedBatches(loader.batch_sampler, num_batches),
        gradient_state=loader.gradient_state,
        device=loader.device,
        rng_types=loader.rng_types,
        generator_to_sync=loader.synchronized_generator,
        non_blocking=loader._non_blocking,
        original_drop_last=loader._drop_last,
        total_batch_size=loader.total_batch_size,
        **loader_options(loader),
    )
    skipped.iteration = loader.iteration
    return skipped
