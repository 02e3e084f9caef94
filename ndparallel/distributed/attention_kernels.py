"""The block kernels of ring attention: attention of some query rows against some key rows, with its log-sum-exp.

Every kernel works on ``[batch, heads, seq, head_dim]`` (heads already repeated for GQA) and returns
``(out, lse[batch, heads, seq_q], aux)``; its backward takes the *global* out and lse of the query rows
(flash-attention style), so blocks merge exactly (:func:`ndparallel.distributed.ring.merge_partial`).

A block runs with no mask, with the kernel's own causal mask (a diagonal block), or with an explicit boolean
mask (:class:`ndparallel.distributed.documents.BlockMask`: documents, padding, a sliding window). A row that
sees no key of its block gets ``out = 0`` and ``lse = -inf``, so it weighs nothing in the merge. The math
kernel (float64, gradcheck) and the CPU flash kernel (an additive mask) take masks; the CUDA kernels do not,
and a masked block on CUDA runs the math kernel (exact, not fast: untested here, no GPU in the suite).

Kernels: SDPA ops that return the LSE (CPU flash, CUDA flash, CUDA memory-efficient), each behind one small
function because their aten signatures differ across torch versions, plus the pure-torch "math" kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ndparallel.distributed.documents import BlockMask
from ndparallel.errors import ConfigError

__all__ = ["KERNELS", "MATH", "Kernel", "attention_kernel", "finite_lse", "softcapped_kernel"]


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, Any]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    takes_masks: bool = False  # explicit block masks; otherwise a masked block runs MATH


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the ``-inf`` of rows that see no key replaced by 0: ``exp(score - lse)`` then stays 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _softcapped(scores: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logit soft-capping (Gemma 2), ``tanh(s / cap) * cap``, and its derivative ``1 - tanh(s / cap)**2``."""
    capped = torch.tanh(scores / softcap)
    return capped * softcap, 1 - capped * capped


def _masked_scores(scores: torch.Tensor, causal: bool, mask: BlockMask | None) -> torch.Tensor:
    if causal:
        hidden = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).triu(1)
        return scores.masked_fill(hidden, float("-inf"))
    if mask is not None:
        return scores.masked_fill(~mask.mask[:, None], float("-inf"))
    return scores


def _math_forward(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None, softcap: float | None = None):
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if softcap is not None:
        scores, _ = _softcapped(scores, softcap)
    scores = _masked_scores(scores, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - finite_lse(lse)[..., None]), v.to(acc))
    return out.to(q.dtype), lse, None


def _math_backward(
    dout, q, k, v, out, lse, causal: bool, scale: float, aux, mask: BlockMask | None = None, softcap=None
):
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, v, dout, out = (t.to(acc) for t in (q, k, v, dout, out))
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    slope = None
    if softcap is not None:
        scores, slope = _softcapped(scores, softcap)
    scores = _masked_scores(scores, causal, mask)
    probs = torch.exp(scores - finite_lse(lse.to(acc))[..., None])
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dprobs = torch.matmul(dout, v.transpose(-2, -1))
    delta = (dout * out).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    if slope is not None:
        dscores = dscores * slope
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-2, -1), q), dv


# aten op, torch 2.11-2.14: (q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out, lse[B,H,S] fp32).
# attn_mask: additive, in q's dtype. A row whose keys are all masked comes back as out 0 and lse 0: set to -inf.
def _cpu_flash_forward(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None):
    additive = None if mask is None else mask.additive(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=additive, scale=scale
    )
    if mask is not None:
        lse = lse.masked_fill(~mask.rows_seen[:, None, :], float("-inf"))
    return out, lse, None


# aten op: (grad_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv).
def _cpu_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux, mask: BlockMask | None = None):
    additive = None if mask is None else mask.additive(q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, finite_lse(lse).to(torch.promote_types(q.dtype, torch.float32)).contiguous(), 0.0,
        causal, attn_mask=additive, scale=scale,
    )  # fmt: skip


# aten op (CUDA): (q, k, v, dropout_p, is_causal, return_debug_mask, *, scale) ->
# (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_mask). Untested here (no GPU).
def _cuda_flash_forward(q, k, v, causal: bool, scale: float):
    out, lse, cum_q, cum_k, _, _, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, rng_state, unused)


# aten op (CUDA): (grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
# philox_seed, philox_offset, *, scale) -> (dq, dk, dv). The aux tensors are the forward's (unused at p=0).
def _cuda_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux):
    cum_q, cum_k, rng_state, unused = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k.contiguous(), v.contiguous(), out, lse, cum_q, cum_k,
        q.shape[-2], k.shape[-2], 0.0, causal, rng_state, unused, scale=scale,
    )  # fmt: skip


# aten op (CUDA): (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale) ->
# (out, lse, philox_seed, philox_offset); lse may be padded along seq to a multiple of 32. Untested here.
def _cuda_efficient_forward(q, k, v, causal: bool, scale: float):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k.contiguous(), v.contiguous(), None, True, 0.0, causal, scale=scale
    )
    no_padding = lse.shape[-1] == q.shape[-2] and q.shape[-2] % 32 != 0  # this torch does not pad
    return out, lse[..., : q.shape[-2]], (seed, offset, no_padding)


# aten op (CUDA): (grad_out, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
# grad_input_mask[4], is_causal, *, scale) -> (dq, dk, dv, dbias). lse padded back as the forward pads it.
def _cuda_efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux):
    seed, offset, no_padding = aux
    if not no_padding:
        lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))
    lse = lse.contiguous()
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k.contiguous(), v.contiguous(), None, out, lse, seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


MATH = Kernel("math", _math_forward, _math_backward, takes_masks=True)
CPU_FLASH = Kernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, takes_masks=True)
CUDA_FLASH = Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
CUDA_EFFICIENT = Kernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward)
KERNELS = {k.name: k for k in (MATH, CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT)}


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def softcapped_kernel(softcap: float) -> Kernel:
    """The math kernel with logit soft-capping: no SDPA op takes a cap, so capped attention always runs here."""
    return Kernel(
        "math",
        functools.partial(_math_forward, softcap=softcap),
        functools.partial(_math_backward, softcap=softcap),
        takes_masks=True,
    )


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, name: str | None = None) -> Kernel:
    """The kernel for this device/dtype (``name`` forces one: ``math``, ``cpu_flash``, ...)."""
    if name is not None:
        if name not in KERNELS:
            raise ConfigError(f"attention kernel {name!r} is not one of {sorted(KERNELS)}")
        return KERNELS[name]
    low_or_single = dtype in (torch.float32, torch.float16, torch.bfloat16)
    if device.type == "cpu" and low_or_single and _has_op("_scaled_dot_product_flash_attention_for_cpu"):
        return CPU_FLASH
    if device.type == "cuda" and low_or_single:
        fits = head_dim % 8 == 0 and head_dim <= 256
        if dtype != torch.float32 and fits and torch.backends.cuda.flash_sdp_enabled():
            return CUDA_FLASH
        if fits and torch.backends.cuda.mem_efficient_sdp_enabled():
            return CUDA_EFFICIENT
    return MATH  # float64 (gradcheck), other devices, unusual head sizes
