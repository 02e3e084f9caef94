"""Byte-level training data that exists on every machine, packed and sharded by the ``dp`` coordinate.

By default the corpus is the Python standard library's own source text (``*.py`` under
``sysconfig``'s stdlib path, files sorted, so it is the same on every rank); ``path`` points at a
user's file or folder instead; a ``.jsonl`` file contributes the ``text`` field of each line. Bytes are
tokens (vocabulary 256). The byte stream is packed into fixed-length windows of ``seq_len + 1`` bytes
(inputs and next-byte labels).

With ``documents=True`` each file (each JSONL line) is one document: it starts with the byte ``DOCUMENT_START``
(0), and every window carries each token's document id and its position inside the document's part in the
window, so attention stays inside documents (the reference model's ``document_ids``; a document cut by a window
edge continues in another window as a new document from position 0). The last token of a document predicts the
next one's start byte: every label is real, so the loss stays a plain mean on any mesh (docs/training.md#data).

Each step draws ``global_batch`` windows from a seeded per-epoch permutation; the rank with
data-parallel index ``dp_rank`` takes the ``dp_rank``-th slice of ``global_batch / dp_size``
windows. Ranks that differ only in their tp or cp coordinate share a dp index and so get identical
batches, as tensor and context parallel require. Position is a step counter: ``state_dict()``
and ``load_state_dict()`` resume exactly.
"""

from __future__ import annotations

import json
import os
import stat
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ndparallel.errors import ConfigError

__all__ = ["DOCUMENT_START", "BatchLoader", "ByteCorpus", "corpus_files", "jsonl_texts"]

VOCAB_SIZE = 256
DOCUMENT_START = 0  # the byte each document starts with in documents mode (NUL: absent from text)


def corpus_files(path: str | Path | None = None) -> list[Path]:
    """The files of the corpus: ``path`` (a file, or every file under a folder), or the stdlib's ``*.py``."""
    if path is None:
        files = _stdlib_sources()
    else:
        root = Path(path)
        if not root.exists():
            raise ConfigError(f"data.path={str(path)!r} does not exist; point it at a text file or a folder")
        files = _files_under(root) if root.is_dir() else [_regular_file(root)]
    if not files:
        raise ConfigError(f"data.path={str(path)!r} holds no files")
    return files


def _stdlib_sources() -> list[Path]:
    """The standard library's ``*.py`` files, site-packages left out, sorted. ``os.walk`` prunes site-packages
    before listing it; ``Path.rglob`` walked it too and took ~0.2 s of every rank's start."""
    found = []
    for folder, folders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        folders[:] = [name for name in folders if name not in ("site-packages", "__pycache__")]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(p for p in found if p.is_file())


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


def _lines(file: Path) -> Iterator[bytes]:
    """The lines of a regular file (checked as :func:`_read_head` checks it); an unreadable file names itself."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            _check_regular(file, os.fstat(fd).st_mode)
            yield from f
    except OSError as err:
        raise ConfigError(
            f"data.path: cannot read {str(file)!r}: {err.strerror or err}; fix its permissions or remove it"
        ) from None


def jsonl_texts(file: Path, field: str, max_bytes: int) -> list[bytes]:
    """The ``field`` of the JSONL file's lines (UTF-8), until they hold ``max_bytes``; a line that is not a JSON
    object with that string field is an error naming the file, the line and the fix."""
    texts, total = [], 0
    for number, line in enumerate(_lines(file), 1):
        if total >= max_bytes:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ConfigError(
                f"data.path: {str(file)!r} line {number} is not JSON ({err}); one object a line"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ConfigError(
                f"data.path: {str(file)!r} line {number} has no string field {field!r}; set data.text_field to the "
                "field that holds each document's text"
            )
        texts.append(record[field].encode())
        total += len(texts[-1])
    return texts


def _documents(path: str | Path | None, max_bytes: int, field: str) -> list[bytes]:
    """The corpus as documents: each file's bytes, or each line's text of a ``.jsonl`` file; at most ``max_bytes``
    (the last one cut there)."""
    docs, total = [], 0
    for file in corpus_files(path):
        if file.suffix == ".jsonl":
            found = jsonl_texts(file, field, max_bytes - total)
        else:
            found = [_read_head(file, max_bytes - total)]
        for doc in found:
            docs.append(doc[: max_bytes - total])
            total += len(docs[-1])
            if total >= max_bytes:
                return docs
    return docs


class ByteCorpus:
    """Up to ``max_bytes`` bytes of the corpus, as windows of ``seq_len + 1`` tokens; ``documents``: each file (JSONL
    line) is one document, starting with ``DOCUMENT_START``, and :meth:`window_documents` gives the windows' masks.
    ``text_field``: the JSONL field holding the text."""

    def __init__(
        self,
        seq_len: int,
        path: str | Path | None = None,
        max_bytes: int = 8_000_000,
        documents: bool = False,
        text_field: str = "text",
    ):
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 1")
        docs = _documents(path, max_bytes, text_field)
        if documents:
            docs = [bytes([DOCUMENT_START]) + doc for doc in docs if doc]
        self.tokens = np.frombuffer(b"".join(docs), dtype=np.uint8)
        self.documents = documents
        self.starts = np.cumsum([0] + [len(doc) for doc in docs[:-1]]).astype(np.int64)  # each document's offset
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

    def window_documents(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, document ids) of window ``index``'s ``seq_len`` input tokens: each token's document, and its
        offset from where that document starts in this window."""
        start = index * self.seq_len
        offsets = np.arange(start, start + self.seq_len)
        ids = np.searchsorted(self.starts, offsets, side="right") - 1
        first = np.maximum(self.starts[ids], start)
        return offsets - first, ids


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

    def _local_indices(self, step: int) -> np.ndarray:
        return self.global_indices(step)[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch at ``step``."""
        windows = torch.from_numpy(
            np.stack([self.corpus.window(i) for i in self._local_indices(step)]).astype(np.int64)
        )
        return windows[:, :-1], windows[:, 1:]

    def masks(self, step: int) -> dict[str, torch.Tensor]:
        """The document masks of :meth:`batch`'s rows, ``positions`` and ``document_ids`` (``[batch, seq_len]``
        int64), as ``TrainStep`` takes them; empty unless the corpus packs documents."""
        if not self.corpus.documents:
            return {}
        parts = [self.corpus.window_documents(i) for i in self._local_indices(step)]
        positions, ids = (torch.from_numpy(np.stack(p).astype(np.int64)) for p in zip(*parts, strict=True))
        return {"positions": positions, "document_ids": ids}

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
