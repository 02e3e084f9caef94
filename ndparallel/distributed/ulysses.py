"""All-to-all (DeepSpeed-Ulysses) attention: exact attention over a sequence split across a process group.

Each rank enters with ``seq / cp`` tokens of every head. One all-to-all (q, k and v packed into one
call) turns that into the whole sequence of ``heads / cp`` heads; attention over the full sequence is
then local (torch's ``scaled_dot_product_attention``); a second all-to-all sends every output row back
to the rank that holds its token. Backward runs the same two all-to-alls in reverse: the gradient of an
all-to-all is the inverse all-to-all.

Sequence layout. Rank ``r`` holds block ``r`` of the sequence, or with load balancing (head-tail)
chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` (``ndparallel.parallel.context_parallel.sequence_indices``).
The received chunks are written to their global positions, so the full sequence each rank attends over
is in natural order and SDPA's causal mask is the real one; the output rows are read back from the
same positions.

Heads. The query heads a rank holds (``heads / tp`` under tensor parallel) must divide by cp. Key/value
heads (grouped-query attention) that do not are repeated to ``lcm(kv_heads, cp)`` heads first: every
query head keeps its own kv head (exact; the repeat's backward sums the gradient back), and each rank
receives exactly the kv heads its query heads read.

Masks (:class:`ndparallel.distributed.documents.DocumentMask`: documents, padding; a sliding window): every rank
holds the whole sequence of its heads after the first all-to-all, in natural order, so the mask is the whole
row's, dense, and SDPA takes it as is.

Attention sinks (``sinks``, one logit per query head added to every softmax denominator: gpt-oss's ``s_aux``)
follow their heads: each rank takes the sinks of its head group and attends in plain torch ops (SDPA has no
sink), so autograd gives the sinks' gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndparallel.config.preflight import check_alltoall_heads
from ndparallel.config.sequence import sequence_problem
from ndparallel.distributed.documents import DocumentMask, Piece
from ndparallel.errors import ConfigError

__all__ = [
    "check_documents",
    "check_local_sequence",
    "check_sinks",
    "chunk_positions",
    "kv_heads_sent",
    "local_attention",
    "ulysses_attention",
]


def check_local_sequence(local: int, cp: int, load_balanced: bool) -> None:
    """ConfigError unless ``local`` rows per rank make a sequence that splits over ``cp`` ranks: the one rule of
    :mod:`ndparallel.config.sequence`, applied where ring and all-to-all attention see only this rank's rows."""
    problem = sequence_problem(local * cp, cp, 1, load_balanced, what="global sequence length")
    if problem:
        raise ConfigError(f"local sequence length {local} on cp_size={cp}: {problem}")


def check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    """ConfigError unless ``sinks`` is None or one logit per query head on this rank."""
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ConfigError(
            f"attention sinks of shape {tuple(sinks.shape)} do not match the {heads} query heads on this rank "
            "(sinks must be one logit per head, sharded like the heads): use tp_size=1"
        )


def check_documents(
    documents: DocumentMask | None, window: int | None, causal: bool, batch: int, seq: int, device: torch.device
) -> DocumentMask | None:
    """The mask to apply over the whole ``[batch, seq]`` row (None: plain causal). A window alone becomes one
    document per row; a mask of another shape, or a mask on non-causal attention, is refused."""
    if documents is None and window is None:
        return None
    if not causal:
        raise ConfigError(
            "document masks, padding masks and sliding windows narrow causal attention; this call is not causal "
            "(mask='none'): drop the mask or use causal attention"
        )
    if documents is None:
        return DocumentMask.from_document_ids(torch.zeros(batch, seq, dtype=torch.long, device=device))
    if (documents.batch, documents.seq_len) != (batch, seq):
        raise ConfigError(
            f"the attention mask covers [batch, seq] = [{documents.batch}, {documents.seq_len}] but the attention "
            f"runs over [{batch}, {seq}] (the whole sequence across cp): build the mask from this batch's rows"
        )
    return documents.to(device)


def local_attention(
    q,
    k,
    v,
    causal: bool,
    scale: float | None,
    sinks: torch.Tensor | None,
    documents: DocumentMask | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention on ``[batch, heads, seq, dim]`` (k, v may have fewer heads): SDPA, or with ``sinks`` the
    softmax over the scores and one sink logit per head, the sink's column then dropped (its value is 0).
    ``documents`` / ``window``: the whole row's mask (``seq`` is the whole sequence, natural order); a row that
    sees no key outputs zeros."""
    grouped = q.shape[1] != k.shape[1]
    documents = check_documents(documents, window, causal, q.shape[0], q.shape[2], q.device)
    if sinks is None and documents is not None and window is None:
        pieces = _document_pieces(documents)
        if pieces is not None:  # each document's rows on their own: the work of its causal attention only
            return _attention_by_pieces(q, k, v, pieces, scale, grouped)
    visible = None if documents is None else documents.dense(window)[:, None]  # [batch, 1, seq, seq]
    if sinks is None:
        if visible is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=grouped)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=grouped)
    if grouped:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    elif causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _document_pieces(documents: DocumentMask) -> list[Piece] | None:
    """The whole rows' mask as rectangles whose query rows do not overlap (one per document run: each row then
    needs one SDPA call, no merge), or None (a window, too many pieces, rows in two pieces: the dense mask)."""
    index = torch.arange(documents.seq_len)
    block = documents.block(index, index, None, ("whole rows",))
    if block is None:
        return []
    if block.pieces is None:
        return None if block.mask is not None else [Piece(slice(None), slice(None), slice(None), block.causal)]
    spans = sorted((b, p.rows.start, p.rows.stop) for p in block.pieces for b in range(documents.batch)[p.batch])
    overlap = any(b == b0 and start < stop0 for (b0, _, stop0), (b, start, _) in zip(spans, spans[1:], strict=False))
    return None if overlap else block.pieces


def _attention_by_pieces(q, k, v, pieces: list[Piece], scale: float | None, grouped: bool) -> torch.Tensor:
    """SDPA per rectangle (unmasked or causal, top-left aligned), each into its rows; rows in none stay zero."""
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    for piece in pieces:
        part = F.scaled_dot_product_attention(
            q[piece.batch, :, piece.rows], k[piece.batch, :, piece.cols], v[piece.batch, :, piece.cols],
            is_causal=piece.causal, scale=scale, enable_gqa=grouped,
        )  # fmt: skip
        out[piece.batch, :, piece.rows] = part
    return out


def kv_heads_sent(kv_heads: int, cp: int) -> int:
    """Key/value heads entering the all-to-all: ``kv_heads``, or ``lcm(kv_heads, cp)`` when cp does not divide it."""
    return kv_heads if kv_heads % cp == 0 else math.lcm(kv_heads, cp)


def chunk_positions(cp: int, load_balanced: bool, device: torch.device | None = None) -> torch.Tensor:
    """Global chunk index of each rank's local chunks, in rank order: ``[0, 1, ..]`` (one block per rank),
    or with load balancing ``[0, 2cp-1, 1, 2cp-2, ..]`` (rank ``r`` holds chunks ``r`` and ``2cp-1-r``)."""
    if not load_balanced:
        return torch.arange(cp, device=device)
    return torch.tensor([c for r in range(cp) for c in (r, 2 * cp - 1 - r)], device=device)


class _Layout:
    """The cp group and where every rank's chunks sit in the global sequence."""

    def __init__(self, group: dist.ProcessGroup | None, load_balanced: bool, device: torch.device):
        self.group = group if group is not None else dist.group.WORLD
        self.cp = dist.get_world_size(self.group)
        self.chunks = 2 if load_balanced else 1  # local chunks per rank
        self.positions = chunk_positions(self.cp, load_balanced, device)  # received chunk j -> global chunk
        self.inverse = torch.empty_like(self.positions)
        self.inverse[self.positions] = torch.arange(len(self.positions), device=device)

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Even split of dim 0 (size cp): slice ``j`` goes to rank ``j``; slice ``j`` of the result came from it."""
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv


def _seq_to_heads(layout: _Layout, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sequence shards ``[B, S/cp, cp*w_i, D]`` -> this rank's head group of the full sequence, packed:
    ``[B, S, sum(w_i), D]`` in global token order (tensor ``i`` in its own ``w_i`` columns)."""
    cp, k = layout.cp, layout.chunks
    batch, local, _, dim = xs[0].shape
    chunk = local // k
    widths = [x.shape[2] // cp for x in xs]
    send = xs[0].new_empty(cp, k, batch, chunk, sum(widths), dim)  # [to rank, local chunk, B, c, heads, D]
    start = 0
    for x, width in zip(xs, widths, strict=True):
        send[..., start : start + width, :].copy_(
            x.unflatten(1, (k, chunk)).unflatten(3, (cp, width)).permute(3, 1, 0, 2, 4, 5)
        )
        start += width
    recv = layout.all_to_all(send).view(cp * k, batch, chunk, sum(widths), dim)  # [from rank x chunk, ...]
    full = send.new_empty(batch, cp * k, chunk, sum(widths), dim)
    full.index_copy_(1, layout.positions, recv.transpose(0, 1))  # each chunk to its global position
    return full.flatten(1, 2)


def _heads_to_seq(layout: _Layout, full: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of ``_seq_to_heads``: ``[B, S, sum(w_i), D]`` -> ``[B, S/cp, cp*w_i, D]`` for each ``i``."""
    cp, k = layout.cp, layout.chunks
    batch, seq, heads, dim = full.shape
    chunk = seq // (cp * k)
    send = full.new_empty(cp * k, batch, chunk, heads, dim)
    send.index_copy_(0, layout.inverse, full.unflatten(1, (cp * k, chunk)).transpose(0, 1))  # global -> send order
    recv = layout.all_to_all(send).view(cp, k, batch, chunk, heads, dim)  # [from rank (head group), chunk, ...]
    outs, start = [], 0
    for width in widths:
        out = full.new_empty(batch, k, chunk, cp, width, dim)
        out.copy_(recv[..., start : start + width, :].permute(2, 1, 3, 0, 4, 5))
        outs.append(out.view(batch, k * chunk, cp * width, dim))
        start += width
    return outs


class _SeqToHeads(torch.autograd.Function):
    """q, k, v sequence shards -> packed full-sequence head group; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, layout: _Layout, *xs: torch.Tensor) -> torch.Tensor:
        ctx.layout, ctx.widths = layout, [x.shape[2] // layout.cp for x in xs]
        return _seq_to_heads(layout, xs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, *_heads_to_seq(ctx.layout, grad, ctx.widths)


class _HeadsToSeq(torch.autograd.Function):
    """Full-sequence head group -> sequence shard of all heads; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, layout: _Layout, y: torch.Tensor) -> torch.Tensor:
        ctx.layout = layout
        return _heads_to_seq(layout, y, [y.shape[2]])[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, _seq_to_heads(ctx.layout, [grad])


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    causal: bool = True,
    load_balanced: bool = True,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    documents: DocumentMask | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's tokens against the whole sequence held across ``group``.

    ``q`` is ``[batch, seq_local, heads, head_dim]``, ``k``/``v`` the same with ``heads`` or fewer
    (grouped-query) heads, rows in the layout of ``load_balanced`` (see the module docstring);
    ``heads`` must divide by the group size. ``sinks``: ``[heads]`` sink logits, or None. Returns the local
    output rows, ``q``'s shape. ``documents`` / ``window``: the whole row's mask (module doc).
    """
    group = group if group is not None else dist.group.WORLD
    cp = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    check_alltoall_heads(heads, 1, cp, what="query heads on this rank")
    check_sinks(sinks, heads)
    if cp == 1:
        qkv = (t.transpose(1, 2) for t in (q, k, v))
        return local_attention(*qkv, causal, scale, sinks, documents, window).transpose(1, 2)
    load_balanced = load_balanced and causal
    check_local_sequence(q.shape[1], cp, load_balanced)
    sent = kv_heads_sent(kv_heads, cp)
    if sent != kv_heads:  # repeat each kv head so cp divides them and every query head keeps its own
        k, v = (t.repeat_interleave(sent // kv_heads, dim=2) for t in (k, v))
    layout = _Layout(group, load_balanced, q.device)
    full = _SeqToHeads.apply(layout, q, k, v)  # [B, S, heads/cp + 2 * sent/cp, D], global order
    qh, kh, vh = (t.transpose(1, 2) for t in full.split([heads // cp, sent // cp, sent // cp], dim=2))
    if sinks is not None:  # this rank attends for head group ``rank`` (the all-to-all's slice order)
        sinks = sinks.unflatten(0, (cp, -1))[dist.get_rank(group)]
    out = local_attention(qh, kh, vh, causal, scale, sinks, documents, window)
    return _HeadsToSeq.apply(layout, out.transpose(1, 2))
