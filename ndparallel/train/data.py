"""Byte-level training data that exists on every machine, packed and sharded by the ``dp`` coordinate.

By default the corpus is the Python standard library's own source text (``*.py`` under
``sysconfig``'s stdlib path, files sorted, so it is the same on every rank); ``path`` points at a
user's file or folder instead. Bytes are tokens (vocabulary 256). The byte stream is packed into
fixed-length windows of ``seq_len + 1`` bytes (inputs and next-byte labels).

Each step draws ``global_batch`` windows from a seeded per-epoch permutation; the rank with
data-parallel index ``dp_rank`` takes the ``dp_rank``-th slice of ``global_batch / dp_size``
windows. Ranks that differ only in their tp or cp coordinate share a dp index and so get identical
batches, as tensor and context parallel require. Position is a step counter: ``state_dict()``
and ``load_state_dict()`` resume exactly.
"""

from __future__ import annotations

import os
import stat
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ndparallel.errors import ConfigError

__all__ = ["BatchLoader", "ByteCorpus", "corpus_files"]

VOCAB_SIZE = 256


def corpus_files(path: str | Path | None = None) -> list[Path]:
    """The files of the corpus: ``path`` (a file, or every file under a folder), or the stdlib's ``*.py``."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    else:
        root = Path(path)
        if not root.exists():
            raise ConfigError(f"data.path={str(path)!r} does not exist; point it at a text file or a folder")
        files = _files_under(root) if root.is_dir() else [_regular_file(root)]
    if not files:
        raise ConfigError(f"data.path={str(path)!r} holds no files")
    return files


def _files_under(root: Path) -> list[Path]:
    """Every file under ``root``, sorted; a sub-folder that cannot be listed is an error naming it."""

    def refuse(err: OSError) -> None:
        raise ConfigError(f"data.path: cannot list {err.filename!r}: {err.strerror}; fix its permissions or remove it")

    found = []
    for folder, _, names in os.walk(root, onerror=refuse, followlinks=True):
        found += [p for p in (Path(folder) / name for name in names) if p.is_file() or p.is_symlink()]
    return sorted(found)


def _regular_file(file: Path) -> Path:
    """``file`` if it is a regular file (or a link to one). A FIFO, socket or device is refused: reading one
    blocks for a writer that may never come, or never ends (``/dev/zero``)."""
    try:
        mode = file.stat().st_mode
    except OSError:
        return file  # a dangling link or a vanished file: _read_head names it
    _check_regular(file, mode)
    return file


def _check_regular(file: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"data.path: {str(file)!r} is {_kind(mode)}, not a regular file; point data.path at a text file or folder"
        )


def _kind(mode: int) -> str:
    kinds = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((name for test, name in kinds.items() if test(mode)), "a socket or other special file")


def _read_head(file: Path, limit: int) -> bytes:
    """At most ``limit`` bytes from the start of ``file``. A file that cannot be read is an error naming
    it: skipping it would let ranks on different machines train on different corpora. Opened without
    blocking, and checked to be a regular file once open (a FIFO swapped in after listing is refused too)."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            _check_regular(file, os.fstat(fd).st_mode)
            return f.read(limit)
    except OSError as err:
        raise ConfigError(
            f"data.path: cannot read {str(file)!r}: {err.strerror or err}; fix its permissions or remove it"
        ) from None


class ByteCorpus:
    """Up to ``max_bytes`` bytes of the corpus, as windows of ``seq_len + 1`` tokens."""

    def __init__(self, seq_len: int, path: str | Path | None = None, max_bytes: int = 8_000_000):
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 1")
        chunks, total = [], 0
        for file in corpus_files(path):
            chunks.append(_read_head(file, max_bytes - total))
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        self.tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        self.seq_len = seq_len
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"the corpus has {len(self.tokens)} bytes, too few for one window of data.seq_len={seq_len}; "
                "use a larger file or a shorter seq_len"
            )

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


class BatchLoader:
    """Endless iterator of this rank's ``(inputs, labels)``, each ``[global_batch / dp_size, seq_len]`` int64."""

    def __init__(self, corpus: ByteCorpus, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if global_batch < 1 or global_batch % dp_size:
            raise ConfigError(
                f"global_batch={global_batch} must be a positive multiple of the data-parallel size {dp_size} "
                f"(dp_replicate x dp_shard); e.g. global_batch={dp_size * max(1, global_batch // dp_size)}"
            )
        if global_batch > corpus.num_windows:
            raise ConfigError(
                f"global_batch={global_batch} exceeds the {corpus.num_windows} windows in the corpus; "
                "use more data or a smaller batch"
            )
        self.corpus = corpus
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.step = 0
        self._steps_per_epoch = corpus.num_windows // global_batch
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.corpus.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, step: int) -> np.ndarray:
        """Window indices of the whole global batch at ``step``."""
        epoch, offset = divmod(step, self._steps_per_epoch)
        start = offset * self.global_batch
        return self._permutation(epoch)[start : start + self.global_batch]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch at ``step``."""
        indices = self.global_indices(step)[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]
        windows = torch.from_numpy(np.stack([self.corpus.window(i) for i in indices]).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            batch = self.batch(self.step)
            self.step += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("global_batch", self.global_batch) != self.global_batch:
            raise ConfigError(
                f"the checkpoint's data position is for global_batch={state['global_batch']}, "
                f"this run uses {self.global_batch}; resume with the same global batch"
            )
        self.step = int(state["step"])
        self.seed = int(state.get("seed", self.seed))
