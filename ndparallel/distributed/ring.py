"""Ring attention: exact causal attention over a sequence split across the ranks of a process group.

Each rank keeps its block of queries. Key/value blocks travel around the ring by point-to-point
send/recv (``rotate="ring"``; the next transfer runs while the current block computes) or are
all-gathered once (``rotate="allgather"``); ``rotate="alltoall"`` hands the call to
``ndparallel.distributed.ulysses`` (heads, not K/V blocks, are exchanged). Every block yields a partial output and its
log-sum-exp (LSE); partial outputs merge exactly::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward pass recirculates the K/V blocks, computes dQ locally from the final output and LSE
(flash-attention style), and sends the dK/dV partial sums around the ring back to their owners
(or reduce-scatters them, for ``allgather``).

Attention sinks (gpt-oss's ``s_aux``: one extra logit per head whose value is zero) merge like one more
block, ``block_out = 0`` and ``block_lse = sink``, after the ring; the backward then needs no change for
q, k, v (the kernels take the final out and LSE), and ``dsink = -sum(exp(sink - lse) * rowsum(dout * out))``.

Logit soft-capping (Gemma 2: every score ``s`` becomes ``tanh(s / cap) * cap`` before the softmax) runs
the math kernel with the cap inside; its backward multiplies the score gradient by ``1 - tanh(s / cap)**2``.

With ``load_balanced=True`` (head-tail / zig-zag), the sequence is cut into ``2 * cp`` chunks and
rank ``r`` holds chunks ``r`` and ``2*cp-1-r`` concatenated; then every (query block, kv block)
pair is fully visible, fully masked or diagonal-causal, and every rank does the same work.

Kernels: SDPA ops that return the LSE (CPU flash, CUDA flash, CUDA memory-efficient), each behind
one small function because their aten signatures differ across torch versions, plus a pure-torch
"math" kernel used for float64 (gradcheck) and wherever no kernel fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndparallel.distributed.attention_kernels import (
    KERNELS,
    MATH,
    Kernel,
    attention_kernel,
    finite_lse,
    softcapped_kernel,
)
from ndparallel.distributed.documents import SKIP, DocumentMask, shard_indices
from ndparallel.distributed.ulysses import check_documents, check_local_sequence, check_sinks, ulysses_attention
from ndparallel.errors import ConfigError

__all__ = ["KERNELS", "ROTATE_METHODS", "RingExchange", "attention_kernel", "merge_partial", "ring_attention"]

ROTATE_METHODS = ("ring", "allgather", "alltoall")  # alltoall: distributed/ulysses.py
_TAG_KV, _TAG_DKV = 11, 12  # distinct P2P tags: K/V and dK/dV transfers between one pair never mix up
# torch 2.13 renamed the flat collectives (the old names warn); torch 2.11/2.12 only have the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# --------------------------------------------------------------------------------------------- comm


class _Pending:
    """An in-flight ring transfer: ``wait()`` returns the received tensor."""

    def __init__(self, works: list, send: torch.Tensor, recv: torch.Tensor):
        self._works, self._send, self.recv = works, send, recv

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._send = None  # the send buffer may be freed now
        return self.recv


class RingExchange:
    """Point-to-point ring over a process group: send to rank+1, receive from rank-1 (group ranks)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        # P2POp takes global ranks in every torch version we support (group_peer is newer).
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int) -> _Pending:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's; non-blocking.

        ``batch_isend_irecv`` groups the pair (NCCL needs that to avoid a send/send deadlock at cp=2).
        """
        tensor = tensor.contiguous()
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return _Pending(dist.batch_isend_irecv(ops), tensor, recv)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[size, *tensor.shape]``: every rank's tensor, in group-rank order."""
        flat = tensor.contiguous().view(-1)
        out = flat.new_empty(self.size * flat.numel())
        _ALL_GATHER(out, flat, group=self.group)
        return out.view(self.size, *tensor.shape)

    def reduce_scatter(self, stacked: torch.Tensor) -> torch.Tensor:
        """Sum ``[size, *shape]`` over ranks and return this rank's ``[*shape]`` slice."""
        out = stacked.new_empty(stacked.shape[1:])
        _REDUCE_SCATTER(out.view(-1), stacked.contiguous().view(-1), op=dist.ReduceOp.SUM, group=self.group)
        return out


# ---------------------------------------------------------------------------------- visible blocks


def visible_blocks(rank: int, src: int, causal: bool, load_balanced: bool, seq: int) -> list[tuple[slice, slice, bool]]:
    """Which (query rows, kv rows, causal) of rank ``rank``'s queries see rank ``src``'s K/V block.

    ``seq`` is the local length. Head-tail layout: local = [chunk r | chunk 2cp-1-r], so the own block
    is plain causal, an earlier rank's first chunk is fully visible to all local queries (its second
    chunk to none), and a later rank's whole block is visible to the local second chunk only.
    """
    whole = slice(0, seq)
    if not causal:
        return [(whole, whole, False)]
    if src == rank:
        return [(whole, whole, True)]
    if not load_balanced:
        return [(whole, whole, False)] if src < rank else []
    half = seq // 2
    if src < rank:
        return [(whole, slice(0, half), False)]
    return [(slice(half, seq), whole, False)]


block_plan = visible_blocks  # the earlier name ("plan" now means a TP table or a planner only)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's (out, lse) into running accumulators ``out``/``lse`` in place (exact softmax merge).
    A row that has seen no key yet on either side (``lse = -inf``) stays at out 0, lse -inf."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = finite_lse(new_lse)
    out.mul_(torch.exp(lse - finite)[..., None])
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - finite)[..., None])
    lse.copy_(new_lse)


# ---------------------------------------------------------------------------------------- the loops


@dataclass
class _Setup:
    kernel: Kernel
    causal: bool
    load_balanced: bool
    scale: float
    repeats: int  # query heads per kv head (GQA)
    acc: torch.dtype  # accumulation dtype: fp32, or fp64 for fp64 inputs
    documents: DocumentMask | None = None  # the whole row's mask (documents, padding), or plain causal
    window: int | None = None  # sliding window (with or without documents)
    cp: int = 1

    def blocks(self, rank: int, src: int, seq: int):
        """``(batch, rows, cols, kernel, causal, mask)`` of every block of ``rank``'s queries against ``src``'s keys
        with a visible pair: the causal layout's blocks, each narrowed by the document mask when there is one (into
        a few unmasked / causal rectangles where documents allow, else one boolean block)."""
        every = slice(None)
        for rows, cols, causal in visible_blocks(rank, src, self.causal, self.load_balanced, seq):
            if self.documents is None:
                yield every, rows, cols, self.kernel, causal, None
                continue
            total = seq * self.cp
            q_index = shard_indices(total, self.cp, rank, self.load_balanced)[rows]
            k_index = shard_indices(total, self.cp, src, self.load_balanced)[cols]
            key = (self.cp, self.load_balanced, rank, src, rows.start, rows.stop, cols.start, cols.stop)
            block = self.documents.block(q_index, k_index, self.window, key)
            if block is SKIP:
                continue  # fully masked: no compute, no gradient
            if block.pieces is not None:
                for piece in block.pieces:
                    piece_rows = slice(rows.start + piece.rows.start, rows.start + piece.rows.stop)
                    piece_cols = slice(cols.start + piece.cols.start, cols.start + piece.cols.stop)
                    yield piece.batch, piece_rows, piece_cols, self.kernel, piece.causal, None
                continue
            kernel = self.kernel if block.mask is None or self.kernel.takes_masks else MATH
            yield every, rows, cols, kernel, block.causal, block if block.mask is not None else None


def _expand(kv_part: torch.Tensor, repeats: int) -> torch.Tensor:
    return kv_part.repeat_interleave(repeats, dim=1) if repeats > 1 else kv_part


def _fold(grad: torch.Tensor, repeats: int) -> torch.Tensor:
    """Sum the gradient of repeated heads back onto their kv head."""
    return grad.unflatten(1, (-1, repeats)).sum(2) if repeats > 1 else grad


def _forward_block(s: _Setup, q, kv, rank, src, out, lse, aux: list) -> None:
    for b, rows, cols, kernel, causal, mask in s.blocks(rank, src, q.shape[2]):
        k, v = _expand(kv[0][b, :, cols], s.repeats), _expand(kv[1][b, :, cols], s.repeats)
        masked = () if mask is None else (mask,)
        block_out, block_lse, block_aux = kernel.forward(q[b, :, rows], k, v, causal, s.scale, *masked)
        merge_partial(out[b, :, rows], lse[b, :, rows], block_out, block_lse.to(s.acc))
        if kernel is s.kernel:
            aux.append(block_aux)


def _backward_block(s: _Setup, dout, q, kv, out, lse, rank, src, dq, dkv, aux) -> None:
    for b, rows, cols, kernel, causal, mask in s.blocks(rank, src, q.shape[2]):
        k, v = _expand(kv[0][b, :, cols], s.repeats), _expand(kv[1][b, :, cols], s.repeats)
        masked = () if mask is None else (mask,)
        dq_b, dk_b, dv_b = kernel.backward(
            dout[b, :, rows], q[b, :, rows], k, v, out[b, :, rows], lse[b, :, rows], causal, s.scale, aux, *masked
        )
        dq[b, :, rows] += dq_b
        dkv[0][b, :, cols] += _fold(dk_b.to(s.acc), s.repeats)
        dkv[1][b, :, cols] += _fold(dv_b.to(s.acc), s.repeats)


def _new_accumulators(q: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, n, d = q.shape
    # Output stored [batch, seq, heads, dim] so the result needs no copy to go back to that layout.
    out = torch.zeros(b, n, h, d, dtype=acc, device=q.device).transpose(1, 2)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def _ring_forward(s: _Setup, q, kv, ring: RingExchange):
    out, lse = _new_accumulators(q, s.acc)
    aux: list = []
    for step in range(ring.size):
        pending = ring.shift(kv, _TAG_KV) if step < ring.size - 1 else None  # overlaps the compute below
        _forward_block(s, q, kv, ring.rank, (ring.rank - step) % ring.size, out, lse, aux)
        if pending is not None:
            kv = pending.wait()
    return out, lse, aux[0] if aux else None


def _ring_backward(s: _Setup, dout, q, kv, out, lse, ring: RingExchange, aux):
    dq = torch.zeros(q.shape, dtype=s.acc, device=q.device)
    incoming = None  # partial dK/dV of the block we hold, from the ranks that held it before us
    for step in range(ring.size):
        next_kv = ring.shift(kv, _TAG_KV) if step < ring.size - 1 else None
        dkv = torch.zeros(kv.shape, dtype=s.acc, device=kv.device)
        _backward_block(s, dout, q, kv, out, lse, ring.rank, (ring.rank - step) % ring.size, dq, dkv, aux)
        if incoming is not None:
            dkv += incoming.wait()
        if ring.size == 1:
            return dq, dkv
        incoming = ring.shift(dkv, _TAG_DKV)  # after the last step this carries our own block's total
        if next_kv is not None:
            kv = next_kv.wait()
    return dq, incoming.wait()


def _allgather_forward(s: _Setup, q, kv, ring: RingExchange):
    out, lse = _new_accumulators(q, s.acc)
    aux: list = []
    gathered = ring.all_gather(kv)
    for src in range(ring.size):
        _forward_block(s, q, gathered[src], ring.rank, src, out, lse, aux)
    return out, lse, aux[0] if aux else None


def _allgather_backward(s: _Setup, dout, q, kv, out, lse, ring: RingExchange, aux):
    gathered = ring.all_gather(kv)  # gathered again rather than kept: activation memory stays 1/cp
    dq = torch.zeros(q.shape, dtype=s.acc, device=q.device)
    dkv = torch.zeros(gathered.shape, dtype=s.acc, device=q.device)
    for src in range(ring.size):
        _backward_block(s, dout, q, gathered[src], out, lse, ring.rank, src, dq, dkv[src], aux)
    return dq, ring.reduce_scatter(dkv)


def _sink_lse(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The per-head sink logits ``[heads]`` as a block LSE shaped like ``lse`` ``[batch, heads, seq]``."""
    return sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)


def _sinks_grad(sinks: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks: a sink's probability is ``exp(sink - lse)`` and its value zero, so its score gradient
    is ``p * (0 - rowsum(dout * out))``, summed over batch and query rows (this rank's rows)."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(_sink_lse(sinks, lse) - lse) * delta).sum((0, 2)).to(sinks.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, causal, rotate, load_balanced, scale, kernel, documents, window):
        ring = RingExchange(group)
        setup = _Setup(kernel, causal, load_balanced, scale, q.shape[2] // k.shape[2],
                       torch.promote_types(q.dtype, torch.float32), documents, window, ring.size)  # fmt: skip
        qh = q.transpose(1, 2)
        kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2)))  # [2, B, Hkv, S, D]: only kv heads travel
        run = _ring_forward if rotate == "ring" else _allgather_forward
        out, lse, aux = run(setup, qh, kv, ring)
        if sinks is not None:  # one more block: output 0, LSE = the sink logit
            merge_partial(out, lse, out.new_zeros(()), _sink_lse(sinks, lse))
        out = out.to(q.dtype)
        ctx.setup, ctx.ring, ctx.rotate, ctx.aux = setup, ring, rotate, aux
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2)))
        run = _ring_backward if ctx.rotate == "ring" else _allgather_backward
        grad_out = grad_out.contiguous().transpose(1, 2)  # autograd may hand an expanded (stride-0) gradient
        dq, dkv = run(ctx.setup, grad_out, q.transpose(1, 2), kv, out, lse, ctx.ring, ctx.aux)
        dq = dq.transpose(1, 2).to(q.dtype)
        dk, dv = (g.transpose(1, 2).to(k.dtype) for g in dkv)
        dsinks = None if sinks is None else _sinks_grad(sinks, grad_out, out, lse)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    causal: bool = True,
    rotate: str = "ring",
    load_balanced: bool = True,
    scale: float | None = None,
    kernel: str | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    documents: DocumentMask | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries against the whole sequence held across ``group``.

    ``q`` is ``[batch, seq_local, heads, head_dim]``; ``k``/``v`` the same with ``heads`` or fewer
    (grouped-query) heads. The local rows must be this rank's shard in the layout given by
    ``load_balanced`` (head-tail chunks ``r`` and ``2*cp-1-r``, else contiguous block ``r``);
    ``ndparallel.parallel.context_parallel.shard_sequence`` produces it. Returns the local output rows.
    ``kernel`` forces one attention kernel (``math``, ``cpu_flash``, ``cuda_flash``, ``cuda_efficient``).
    ``rotate="alltoall"`` runs :func:`ndparallel.distributed.ulysses.ulysses_attention` (query heads must divide by cp).
    ``sinks`` (``[heads]``, gpt-oss's ``s_aux``) adds one logit per head to every softmax denominator.
    ``softcap`` caps every score ``s * scale`` to ``tanh(s * scale / softcap) * softcap`` (Gemma 2) before
    the mask and softmax; it runs the math kernel, on ``ring`` and ``allgather`` (not with sinks).
    ``documents`` (:class:`~ndparallel.distributed.documents.DocumentMask` of the whole ``[batch, seq]`` row, on
    every rank alike) and ``window`` (a sliding window: query ``i`` sees keys ``i - window < j <= i``) narrow the
    causal mask: fully masked blocks are skipped, the others run with their block of the mask (causal only).
    """
    if rotate not in ROTATE_METHODS:
        raise ConfigError(f"cp_rotate_method={rotate!r} is not one of {list(ROTATE_METHODS)}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ConfigError(
            f"ring_attention expects q [batch, seq, heads, head_dim] and k, v of equal shape with the same "
            f"batch, seq and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ConfigError(f"kv heads={k.shape[2]} must divide query heads={q.shape[2]} (grouped-query attention)")
    check_sinks(sinks, q.shape[2])
    cp = dist.get_world_size(group if group is not None else dist.group.WORLD)
    documents = check_documents(documents, window, causal, q.shape[0], q.shape[1] * cp, q.device)
    load_balanced = load_balanced and causal and cp > 1
    check_local_sequence(q.shape[1], cp, load_balanced)
    if softcap is not None and (rotate == "alltoall" or sinks is not None or kernel not in (None, "math")):
        what = "sinks" if sinks is not None else f"cp_rotate_method={rotate!r}" if rotate == "alltoall" else kernel
        raise ConfigError(
            f"attention logit soft-capping with {what} is not implemented: it runs the math kernel of "
            "cp_rotate_method='ring' or 'allgather', without sinks"
        )
    if rotate == "alltoall":
        if kernel is not None:
            raise ConfigError(
                f"kernel={kernel!r} picks a ring block kernel; cp_rotate_method='alltoall' runs torch's SDPA"
            )
        return ulysses_attention(q, k, v, group, causal, load_balanced, scale, sinks, documents, window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if softcap is not None:
        chosen = softcapped_kernel(softcap)
    else:
        chosen = attention_kernel(q.device, q.dtype, q.shape[-1], kernel)
    return _RingAttention.apply(q, k, v, sinks, group, causal, rotate, load_balanced, scale, chosen, documents, window)
