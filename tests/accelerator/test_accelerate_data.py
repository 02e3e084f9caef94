"""Accelerate's data semantics in ndparallel's prepared loaders, against 🤗 Accelerate's own classes (installed
with the trainer extra): whole batches dealt round-robin to the data ranks, ``even_batches`` (the last round
completed from the first samples of the pass), ``split_batches``, the loader's ``drop_last``, batch samplers
without a batch size; and the number of samples ``gather_for_metrics`` keeps at the end of a pass."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import ndparallel as ndp
from ndparallel.accelerator.dealing import DealtBatches
from ndparallel.errors import ConfigError

accelerate_data_loader = pytest.importorskip("accelerate.data_loader")


def _cases():
    for ranks, samples, batch, drop_last, even, split in itertools.product(
        (1, 2, 3, 4), (1, 2, 5, 7, 8, 12, 13, 16, 23), (1, 2, 3, 4), (False, True), (True, False), (False, True)
    ):
        if split and batch % ranks:
            continue
        yield ranks, samples, batch, drop_last, even, split


def test_dealt_batches_equal_accelerates_batch_sampler_shard():
    checked = 0
    for ranks, samples, batch, drop_last, even, split in _cases():
        batches = BatchSampler(SequentialSampler(range(samples)), batch, drop_last)
        for rank in range(ranks):
            ours = DealtBatches(batches, ranks, rank, split, even)
            theirs = accelerate_data_loader.BatchSamplerShard(batches, ranks, rank, split, even)
            case = (ranks, rank, samples, batch, drop_last, even, split)
            assert list(ours) == list(theirs), case
            assert len(ours) == len(theirs), case
            checked += 1
    assert checked > 1000


class _Uneven:
    """A batch sampler of varying batch sizes and no ``batch_size`` (Accelerate deals it batch by batch)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def __iter__(self):
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


def test_batch_samplers_without_a_batch_size_are_dealt_as_accelerate_deals_them():
    for sizes, ranks, even in itertools.product(([3, 1, 2], [2, 2, 2, 5, 1], [4]), (2, 3), (True, False)):
        for rank in range(ranks):
            ours = list(DealtBatches(_Uneven(sizes), ranks, rank, False, even))
            theirs = list(accelerate_data_loader.BatchSamplerShard(_Uneven(sizes), ranks, rank, False, even))
            assert ours == theirs, (sizes, ranks, rank, even)


def test_split_batches_needs_a_batch_size_the_ranks_divide():
    with pytest.raises(ConfigError, match="batch size is 3; use a batch size divisible by 2"):
        DealtBatches(BatchSampler(SequentialSampler(range(8)), 3, False), 2, 0, split_batches=True)


@pytest.fixture
def single_process():
    yield
    ndp.destroy_distributed()


def test_one_process_keeps_the_loaders_own_order_and_metrics_are_not_cut(single_process):
    # One process: Accelerate leaves the sampler alone (a shuffling loader draws from the global generator).
    acc = ndp.Accelerator(device_type="cpu")
    dataset = TensorDataset(torch.arange(10))
    torch.manual_seed(3)
    expected = [b.tolist() for (b,) in DataLoader(dataset, batch_size=4, shuffle=True)]
    torch.manual_seed(3)
    prepared = acc.prepare(DataLoader(dataset, batch_size=4, shuffle=True))
    seen = []
    for (batch,) in prepared:
        seen.append(acc.gather_for_metrics(batch).tolist())
        assert acc.gradient_state.remainder == 2 and acc.gradient_state.in_dataloader
    assert seen == expected and prepared.total_batch_size == 4
    assert not acc.gradient_state.in_dataloader
