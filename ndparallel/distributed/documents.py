"""Which keys a query may attend: the one mask representation of ndparallel's attention kernels.

Every mask beyond plain causal (padding, packed documents, a sliding window) reduces to one
:class:`DocumentMask` over the whole, unsharded ``[batch, seq]`` row, plus a per-layer window::

    query i sees key j  <=>  j <= i  and  query_docs[i] == key_docs[j]  and  (window is None or i - j < window)

* packed documents: ``query_docs == key_docs`` = the document index of each token;
* padding (Hugging Face's 2-D ``attention_mask``, a key mask): ``key_docs = -1`` at padded keys, which no
  query's document equals, and ``query_docs = 0``: a padded query row attends its row's real tokens causally,
  as transformers' SDPA mask makes it; a row with no visible key (left padding) outputs zeros;
* a token with a negative document id (the reference model's ``document_ids``) is padding both ways.

The reductions from user inputs live in :mod:`ndparallel.parallel.masks`; this module only answers, for a
block of query rows and key rows given by their global indices, whether the block is skipped (fully masked),
runs unmasked, runs the kernel's own causal mask, or needs an explicit ``[batch, q, k]`` boolean mask. The
answers are cached on the mask, which one forward shares among its layers and their backward passes.
docs/context-parallel.md#masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SKIP", "BlockMask", "DocumentMask", "shard_indices"]


def shard_indices(seq_len: int, cp: int, rank: int, load_balanced: bool, device=None) -> torch.Tensor:
    """Global positions of rank ``rank``'s rows: chunks ``r`` and ``2cp-1-r`` of ``2cp`` (head-tail), else block ``r``.
    The layout rule of :func:`ndparallel.parallel.context_parallel.sequence_indices` (which checks the length)."""
    if cp == 1 or not load_balanced:
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    c = seq_len // (2 * cp)
    tail = (2 * cp - 1 - rank) * c
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat((head, torch.arange(tail, tail + c, device=device)))


@dataclass
class BlockMask:
    """How one (query rows, key rows) block runs: ``causal`` (the kernel's own lower-triangular mask, on a
    diagonal block), or ``mask`` ``[batch, q, k]`` (True: attend); both unset: the whole block is visible."""

    causal: bool = False
    mask: torch.Tensor | None = None
    pieces: list[Piece] | None = None  # the mask as a few unmasked / causal rectangles (documents, no window)
    _additive: dict = field(default_factory=dict, repr=False)

    @property
    def rows_seen(self) -> torch.Tensor:
        """``[batch, q]``: whether a query row sees any key of the block."""
        if "rows" not in self._additive:
            self._additive["rows"] = self.mask.any(-1)
        return self._additive["rows"]

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as ``[batch, 1, q, k]`` scores to add (0 or -inf), the form SDPA's CPU kernel takes."""
        if dtype not in self._additive:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive[dtype] = zeros.masked_fill_(~self.mask, float("-inf"))[:, None]
        return self._additive[dtype]


SKIP = None  # a fully masked block: not computed at all
MAX_PIECES = 32  # more rectangles than this in one block: one masked kernel call is cheaper than the calls


@dataclass(frozen=True)
class Piece:
    """A rectangle of a block that one document fills: rows ``rows`` of batch rows ``batch`` see keys ``cols``
    (block-local slices), all of them, or (``causal``, always square) each row ``i`` the keys up to ``i``."""

    batch: slice
    rows: slice
    cols: slice
    causal: bool


@dataclass
class DocumentMask:
    """``query_docs`` / ``key_docs``: ``[batch, seq]`` int64 over the whole (unsharded) sequence; see the module doc."""

    query_docs: torch.Tensor
    key_docs: torch.Tensor
    delivered: int = field(default=0, compare=False)  # attention calls that received it (a model-level check)
    _blocks: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.query_docs.shape != self.key_docs.shape or self.query_docs.dim() != 2:
            raise ValueError(
                f"DocumentMask needs [batch, seq] query_docs and key_docs of one shape, got "
                f"{tuple(self.query_docs.shape)} and {tuple(self.key_docs.shape)}"
            )

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor) -> DocumentMask:
        """One id per token (``[batch, seq]``): equal ids attend each other causally; a negative id is padding
        (attends nothing, attended by nothing)."""
        ids = document_ids.long()
        return cls(torch.where(ids < 0, -2, ids), torch.where(ids < 0, -1, ids))

    @classmethod
    def from_key_padding(cls, keep: torch.Tensor) -> DocumentMask:
        """Hugging Face's 2-D ``attention_mask`` (True/1: a real token) as a key mask: see the module doc."""
        keep = keep.bool()
        return cls(torch.zeros_like(keep, dtype=torch.long), torch.where(keep, 0, -1))

    @property
    def batch(self) -> int:
        return self.query_docs.shape[0]

    @property
    def seq_len(self) -> int:
        return self.query_docs.shape[1]

    def to(self, device: torch.device) -> DocumentMask:
        if self.query_docs.device == device:
            return self
        return DocumentMask(self.query_docs.to(device), self.key_docs.to(device))

    def rows(self, batch: slice) -> DocumentMask:
        """The mask of some rows of the batch (a data-parallel or micro-batch slice)."""
        return DocumentMask(self.query_docs[batch], self.key_docs[batch])

    def visible(self, q_index: torch.Tensor, k_index: torch.Tensor, window: int | None) -> torch.Tensor:
        """``[batch, len(q_index), len(k_index)]`` bool: which keys each query sees (global indices)."""
        q_index, k_index = q_index.to(self.query_docs.device), k_index.to(self.query_docs.device)
        distance = q_index[:, None] - k_index[None, :]
        allowed = distance >= 0
        if window is not None:
            allowed &= distance < window
        same = self.query_docs[:, q_index, None] == self.key_docs[:, None, k_index]
        return same & allowed

    def dense(self, window: int | None = None) -> torch.Tensor:
        """``[batch, seq, seq]`` bool over the whole sequence in natural order (all-to-all and local attention);
        built once per window and kept (every layer of a forward, and their backward, share it)."""
        key = ("dense", window)
        if key not in self._blocks:
            index = torch.arange(self.seq_len, device=self.query_docs.device)
            self._blocks[key] = self.visible(index, index, window)
        return self._blocks[key]

    def block(self, q_index: torch.Tensor, k_index: torch.Tensor, window: int | None, key: tuple) -> BlockMask | None:
        """The block of queries ``q_index`` and keys ``k_index``: :data:`SKIP`, or how to run it (cached by ``key``,
        which must name the block and window uniquely)."""
        cache_key = (*key, window)
        if cache_key not in self._blocks:
            # documents alone: read from the runs of document ids (no [q, k] mask is built); a window, or more
            # rectangles than MAX_PIECES: the boolean mask of the block
            pieces = self._pieces(q_index.cpu(), k_index.cpu()) if window is None else None
            if pieces is not None:
                block = _from_pieces(pieces, len(q_index), len(k_index), self.batch)
            else:
                block = _classify(self.visible(q_index, k_index, window), q_index, k_index)
            self._blocks[cache_key] = block
        return self._blocks[cache_key]

    def _pieces(self, q_index: torch.Tensor, k_index: torch.Tensor) -> list[Piece] | None:
        """The visible part of a block as rectangles, each one document's run of queries against a run of its keys:
        earlier keys fully visible, the keys from the first query on causal. None when more than ``MAX_PIECES``."""
        pieces: list[Piece] = []
        for b in range(self.batch):
            q_runs = _runs(self.query_docs[b, q_index].cpu(), q_index)
            k_runs: dict[int, list] = {}
            for doc, local, run in _runs(self.key_docs[b, k_index].cpu(), k_index):
                k_runs.setdefault(doc, []).append((local, run))
            rows = slice(b, b + 1) if self.batch > 1 else slice(None)
            for doc, (qs, qe), (ga, gb) in q_runs:
                if len(pieces) > MAX_PIECES:
                    return None
                for (ks, _), (ka, kb) in k_runs.get(doc, []) if doc >= 0 else []:
                    if ka < ga:  # keys before every query of the run: all visible
                        end = min(kb, ga)
                        pieces.append(Piece(rows, slice(qs, qe), slice(ks, ks + end - ka), False))
                    a, b_end = max(ka, ga), min(kb, gb)
                    if a < b_end:  # keys a..b_end: a square causal piece aligned at a, then the rows after b_end
                        cols = slice(ks + a - ka, ks + b_end - ka)
                        pieces.append(Piece(rows, slice(qs + a - ga, qs + b_end - ga), cols, True))
                        if b_end < gb:  # see every one of those keys (square: no kernel's causal alignment matters)
                            pieces.append(Piece(rows, slice(qs + b_end - ga, qe), cols, False))
            if len(pieces) > MAX_PIECES:
                return None
        return pieces


def _from_pieces(pieces: list[Piece], rows: int, cols: int, batch: int) -> BlockMask | None:
    """The block as its rectangles: none (skipped), one covering the whole block in each batch row, all alike
    (unmasked, or the kernel's causal mask: a causal piece is square and aligned), or the list."""
    if not pieces:
        return SKIP
    whole = all((p.rows.start, p.rows.stop, p.cols.start, p.cols.stop) == (0, rows, 0, cols) for p in pieces)
    kinds = {p.causal for p in pieces}
    if whole and len(kinds) == 1 and sum(len(range(batch)[p.batch]) for p in pieces) == batch:
        return BlockMask(causal=kinds.pop())
    return BlockMask(pieces=pieces)


def _classify(visible: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor) -> BlockMask | None:
    if not bool(visible.any()):
        return SKIP
    if bool(visible.all()):
        return BlockMask()
    diagonal = q_index.shape == k_index.shape and bool((q_index == k_index.to(q_index.device)).all())
    if diagonal and bool((visible == torch.ones_like(visible[0]).tril()).all()):
        return BlockMask(causal=True)
    return BlockMask(mask=visible)


def _runs(docs: torch.Tensor, index: torch.Tensor) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Maximal runs of one document over consecutive global indices: ``(doc, (local start, end), (global start,
    end))`` each."""
    breaks = torch.ones(len(docs), dtype=torch.bool)
    breaks[1:] = (docs[1:] != docs[:-1]) | (index[1:] != index[:-1] + 1)
    starts = breaks.nonzero().flatten().tolist() + [len(docs)]
    return [
        (int(docs[s]), (s, e), (int(index[s]), int(index[s]) + e - s)) for s, e in zip(starts, starts[1:], strict=False)
    ]
