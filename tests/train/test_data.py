"""Byte-level data: deterministic, packed, and sharded by the dp coordinate only."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest
import torch

from ndparallel import ConfigError
from ndparallel.train.data import BatchLoader, ByteCorpus, corpus_files


def test_default_corpus_is_stdlib_source():
    files = corpus_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert files == sorted(files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])  # the walk prunes site-packages; rglob's answer, filtered
    assert files == sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def test_windows_are_shifted_labels_and_deterministic():
    corpus = ByteCorpus(seq_len=32, max_bytes=200_000)
    loader = BatchLoader(corpus, global_batch=8, seed=3)
    inputs, labels = loader.batch(0)
    assert inputs.shape == labels.shape == (8, 32)
    assert inputs.dtype == torch.int64 and int(inputs.max()) < 256
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    again = BatchLoader(ByteCorpus(seq_len=32, max_bytes=200_000), global_batch=8, seed=3)
    assert torch.equal(again.batch(5)[0], loader.batch(5)[0])
    assert not torch.equal(loader.batch(0)[0], loader.batch(1)[0])
    assert not torch.equal(BatchLoader(corpus, 8, seed=4).batch(0)[0], inputs)


def test_dp_shards_partition_the_global_batch():
    corpus = ByteCorpus(seq_len=16, max_bytes=100_000)
    full = BatchLoader(corpus, global_batch=8).batch(2)[0]
    shards = [BatchLoader(corpus, global_batch=8, dp_rank=r, dp_size=4).batch(2)[0] for r in range(4)]
    assert all(s.shape == (2, 16) for s in shards)
    assert torch.equal(torch.cat(shards), full)


def test_epochs_wrap_and_resume_state():
    corpus = ByteCorpus(seq_len=64, max_bytes=5_000)  # 78 windows -> 9 steps of 8 per epoch
    loader = BatchLoader(corpus, global_batch=8, seed=1)
    it = iter(loader)
    batches = [next(it)[0] for _ in range(12)]  # crosses an epoch boundary
    state = loader.state_dict()
    resumed = BatchLoader(corpus, global_batch=8, seed=0)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))[0], next(it)[0])
    assert len(batches) == 12
    with pytest.raises(ConfigError, match="same global batch"):
        BatchLoader(corpus, global_batch=4).load_state_dict(state)


def test_user_file_and_bad_inputs(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello world " * 100)
    corpus = ByteCorpus(seq_len=8, path=text)
    assert bytes(corpus.window(0)[:5].tolist()) == b"hello"
    with pytest.raises(ConfigError, match="does not exist"):
        ByteCorpus(seq_len=8, path=tmp_path / "missing")
    with pytest.raises(ConfigError, match="too few for one window"):
        ByteCorpus(seq_len=10_000, path=text)
    with pytest.raises(ConfigError, match="multiple of the data-parallel size 4"):
        BatchLoader(corpus, global_batch=6, dp_size=4)


def test_unreadable_or_failing_files_are_named(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"x" * 1000)
    # A file in the folder whose read fails (/proc/self/mem at offset 0 gives EIO, even for root):
    # named, never skipped (ranks could otherwise read different corpora) nor "0 bytes".
    failing = folder / "b.txt"
    failing.symlink_to("/proc/self/mem")
    with pytest.raises(ConfigError, match=r"cannot read .*b\.txt.*Input/output error"):
        ByteCorpus(seq_len=8, path=folder)
    with pytest.raises(ConfigError, match=r"cannot read .*/proc/self/mem"):
        ByteCorpus(seq_len=8, path="/proc/self/mem")
    failing.unlink()
    secret = folder / "c.txt"
    secret.write_bytes(b"y" * 1000)
    secret.chmod(0)
    try:
        if not os.access(secret, os.R_OK):  # root reads it anyway: nothing to refuse then
            with pytest.raises(ConfigError, match=r"cannot read .*c\.txt.*Permission denied"):
                ByteCorpus(seq_len=8, path=folder)
    finally:
        secret.chmod(0o644)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/self/io (Linux)")
def test_max_bytes_reads_only_what_it_needs(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # 512 MB, sparse: costs no disk
        f.truncate(512 * 2**20)

    def bytes_read() -> int:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])

    before = bytes_read()
    corpus = ByteCorpus(seq_len=8, path=big, max_bytes=1000)
    read = bytes_read() - before
    assert len(corpus.tokens) == 1000
    assert read < 1_000_000, f"read {read} bytes for max_bytes=1000"
