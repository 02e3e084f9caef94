"""Bytes the memory-bound kernels of a training step move: per block, the loss head, the optimizer and the
casts of mixed precision. Eager runs each op as its own kernel (every op reads its inputs and writes its output
from HBM); ``torch.compile`` fuses each chain of ops between two matmuls into one kernel that reads the chain's
inputs and writes its outputs once.

Counted op by op for the reference block (``ndparallel.models.transformer``), per token, with ``e`` the compute
dtype's bytes and ``r`` the residual stream's (fp32 under autocast, ``e`` under FSDP's bf16 policy); dims are a
tensor-parallel rank's (``d/t`` under sequence parallel for the norms and the residual stream). A forward op's
backward moves about twice its bytes (it reads the incoming gradient and the saved inputs, writes the input
gradients): ``BACKWARD_FACTOR``. Formulas and their terms: docs/planning.md ("Memory-bound kernels").
"""

from __future__ import annotations

from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.training import TrainingSpec

__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "BACKWARD_FACTOR",
    "block_forward_bytes",
    "head_bytes",
    "optimizer_bytes",
    "weight_cast_bytes",
]

BACKWARD_FACTOR = 2.0
ADAMW_BYTES_PER_PARAM = 28 + 12
"""Fused AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (fp32: 28 bytes);
gradient-norm clipping reads every gradient for the norm and scales it in place (12 bytes)."""


def block_forward_bytes(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, compiled: bool, residual: int
) -> dict[str, float]:
    """Bytes per token of one block's memory-bound forward ops, by op (``residual``: bytes of the residual stream).

    Eager: two residual adds (read ``r`` + ``e``, write ``r``), two RMSNorms (fused kernel: read and write the
    stream), the casts autocast makes of the norm output for each of the five linears reading it, RoPE on q and k
    (upcast to fp32, four half-size products, two half-size sums, a concatenation, the downcast: ``2e + 40``
    bytes per element), GQA's repeat of k and v, the copy of SDPA's output back to ``[tokens, heads x head_dim]``,
    SwiGLU's silu and product. A composite RMSNorm (``fused_norm=False``: upcast, square, mean, scale, downcast,
    weight: ``4r + 28`` bytes per element) instead of the fused kernel's ``2r``. Compiled: add + norm + cast fuse
    (read stream and branch, write stream and one compute-dtype copy), RoPE reads and writes each element once,
    silu x product reads two and writes one.
    """
    e, r, t = train.bytes.compute, residual, mesh.tp
    d, q, kv, f = model.dim / t, model.q_dim / t, model.kv_dim / t, model.ffn_dim / t
    casts = 5 * (r + e) * model.dim / t if r != e else 0.0
    gqa = 2 * e * (kv + q) if model.n_kv_heads < model.n_heads and mesh.cp == 1 else 0.0
    if compiled:
        return {
            "norm + residual": 2 * (2 * r + 2 * e) * d,
            "rope": 2 * e * (q + kv),
            "gqa repeat": gqa,
            "attention layout": 2 * e * q,
            "swiglu": 3 * e * f,
        }
    return {
        "residual add": 2 * (2 * r + e) * d,
        "norm": 2 * (2 * r if train.fused_norm else 4 * r + 28) * d,
        "autocast casts": casts,
        "rope": (2 * e + 40) * (q + kv),
        "gqa repeat": gqa,
        "attention layout": 2 * e * q,
        "swiglu": 5 * e * f,
    }


def head_bytes(model: ModelSpec, train: TrainingSpec, mesh: MeshShape, compiled: bool, residual: int) -> float:
    """Bytes per token of the loss head's memory-bound ops, forward + backward: the final norm, and the fp32
    cross-entropy over ``V/t`` logits. Eager: upcast (``e + 4``), log-softmax (three reads of the max, the sum and
    the output, one write: 16), its gradient (the loss's scatter 4, log-softmax backward 16) and the downcast
    (``4 + e``): ``2e + 40`` per logit. Compiled (one graph): the fused kernel reads the logits forward and
    again backward and writes their gradient: ``3e``."""
    e, vocab = train.bytes.compute, model.vocab_size / mesh.tp
    norm = (1 + BACKWARD_FACTOR) * 2 * residual * model.dim / mesh.tp
    return norm + (3 * e if compiled else 2 * e + 40) * vocab


def weight_cast_bytes(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, params_local: float, gathered: float | None = None
) -> float:
    """Mixed-precision traffic of one micro-batch on the rank's parameters, outside the blocks' activations.

    FSDP2 (bf16 policy): each all-gather casts the fp32 shard into the send buffer (``4 + e`` per local element)
    and copies the gathered output into the unsharded parameters (``2e`` per element of the unit); the
    reduce-scatter copies the bf16 gradient into an fp32 buffer (``e + 4``) and accumulates the shard (12 bytes
    per local element). Autocast (no FSDP): each forward casts the matmul weights (``4 + e``), each backward
    casts their gradients up (``e + 4``) and accumulates them (12). fp32: nothing but the gradient accumulation.
    ``gathered``: the elements the units gather when not ``params_local x dp_shard x cp`` (routed experts).
    """
    e, p = train.bytes.compute, train.bytes.param
    full = params_local * mesh.fsdp if gathered is None else gathered  # the tp-local elements the units gather
    if mesh.fsdp > 1:
        gathers = 2 if train.reshard_after_forward else 1
        cast = (p + e) if e != p else 0.0
        return gathers * (cast * params_local + 2 * e * full) + (e + 4 if e != 4 else 0) * full + 12 * params_local
    if e != p:
        return (2 * (p + e) + 12) * params_local
    return 12 * params_local


def optimizer_bytes(params_local: float) -> float:
    """Bytes the optimizer step (AdamW + clipping) moves over the rank's parameter shard."""
    return ADAMW_BYTES_PER_PARAM * params_local
