"""Compute time of one rank, by kind: the matmuls by shape, attention, the memory-bound ops, the recompute of
checkpointing, the mixed-precision casts and the optimizer step. Assembled from ``kernels`` (time of a kernel)
and ``memory_ops`` (bytes of the memory-bound ops); step time and overlap are ``timing``'s.

Per micro-batch a data-parallel rank's ``T = micro_batch x seq / cp`` tokens run through every block on each
of its ``tp`` ranks, whose matmuls are the block's with the split dim divided by ``tp``. A linear ``in -> out``
runs one GEMM forward (``[T, in] @ [in, out]``) and two backward (input gradient ``[T, out] @ [out, in]``,
weight gradient ``[in, T] @ [T, out]``). Flash attention executes ``2 s^2 q`` FLOPs per sequence and block
forward (causal: half of ``4 s^2 q``) and 2.5 times that backward (it recomputes the scores). An MoE block runs
attention, then the router, the shared experts and each local expert's GEMMs on its share of the routed rows
(:func:`ndparallel.estimate.experts.expert_gemms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndparallel.estimate.checkpointing import recomputed_linears
from ndparallel.estimate.cluster import ClusterSpec
from ndparallel.estimate.experts import expert_gemms, moe_forward_bytes
from ndparallel.estimate.kernels import attention_s, matmul_s, memory_s
from ndparallel.estimate.memory import checkpointed_blocks, gathered_params, params_per_rank, residual_bytes
from ndparallel.estimate.memory_ops import (
    BACKWARD_FACTOR,
    block_forward_bytes,
    head_bytes,
    optimizer_bytes,
    weight_cast_bytes,
)
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.pipeline import RankShare, rank_shares
from ndparallel.estimate.training import TrainingSpec

__all__ = ["ATTENTION_BACKWARD", "ComputeTime", "block_linears", "compute_time"]

ATTENTION_BACKWARD = 2.5
"""Flash attention's backward executes 2.5 x its forward FLOPs (five matmuls to two)."""


def block_linears(model: ModelSpec, tp: int) -> dict[str, tuple[float, float]]:
    """(in, out) features of each of a block's linears on one tensor-parallel rank."""
    d, q, kv, f = model.dim, model.q_dim / tp, model.kv_dim / tp, model.ffn_dim / tp
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w1": (d, f), "w3": (d, f), "w2": (f, d)}


@dataclass(frozen=True)
class ComputeTime:
    """Seconds of one rank's compute: per micro-batch forward and backward (recompute included, under its own
    kind), and once per step (optimizer)."""

    forward: dict[str, float]
    backward: dict[str, float]
    per_step: dict[str, float] = field(default_factory=dict)
    attention_forward: float = 0.0
    attention_backward: float = 0.0
    """Attention alone (what context parallel's ring transfers hide behind), recompute included."""

    @property
    def forward_s(self) -> float:
        return sum(self.forward.values())

    @property
    def backward_s(self) -> float:
        return sum(self.backward.values())

    def step_by_kind(self, micro_steps: int) -> dict[str, float]:
        """Seconds per step by kind (forward + backward of every micro-batch, + the per-step kinds)."""
        kinds: dict[str, float] = {}
        for part in (self.forward, self.backward):
            for kind, seconds in part.items():
                kinds[kind] = kinds.get(kind, 0.0) + micro_steps * seconds
        for kind, seconds in self.per_step.items():
            kinds[kind] = kinds.get(kind, 0.0) + seconds
        return kinds


def _linear_s(m: float, n_in: float, n_out: float, c: ClusterSpec, backward: bool) -> float:
    if not backward:
        return matmul_s(m, n_out, n_in, c.peak_flops, c.hbm_bw)
    return matmul_s(m, n_in, n_out, c.peak_flops, c.hbm_bw) + matmul_s(n_in, n_out, m, c.peak_flops, c.hbm_bw)


def _moe_block_s(
    model: ModelSpec, mesh: MeshShape, c: ClusterSpec, tokens: float, linears: dict[str, tuple[float, float]]
) -> tuple[float, float]:
    """(forward, backward) matmul seconds of one MoE block: attention's linears, then the router, shared experts and
    local experts' GEMMs."""
    gemms = [(tokens, *linears[name], 1) for name in ("wq", "wk", "wv", "wo")] + expert_gemms(model, mesh, tokens)
    forward = sum(n * _linear_s(m, i, o, c, False) for m, i, o, n in gemms)
    return forward, sum(n * _linear_s(m, i, o, c, True) for m, i, o, n in gemms)


def _mixed(dense: float, moe: float, blocks: int, moe_blocks: int) -> float:
    """Seconds of one block on average, ``moe_blocks`` of ``blocks`` MoE blocks."""
    return dense if not moe_blocks else ((blocks - moe_blocks) * dense + moe_blocks * moe) / blocks


def _share_time(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, c: ClusterSpec, share: RankShare
) -> ComputeTime:
    tokens = train.micro_batch * train.seq_len / mesh.cp
    blocks = share.blocks
    mode, option = train.activation_checkpointing, train.selective_ac_option
    recomputed = checkpointed_blocks(blocks, mode, option)
    again = recomputed_linears(mode, option)
    linears = block_linears(model, mesh.tp)
    fwd_mm = sum(_linear_s(tokens, i, o, c, False) for i, o in linears.values())
    bwd_mm = sum(_linear_s(tokens, i, o, c, True) for i, o in linears.values())
    re_mm = sum(_linear_s(tokens, *linears[name], c, False) for name in again)
    head_mm = _linear_s(tokens, model.dim, model.vocab_size / mesh.tp, c, False) if share.head else 0.0
    head_bwd_mm = _linear_s(tokens, model.dim, model.vocab_size / mesh.tp, c, True) if share.head else 0.0

    attn_flops = train.micro_batch * 2 * train.seq_len**2 * model.q_dim / mesh.tp / mesh.cp
    attn_fwd = attention_s(attn_flops, c.peak_flops, c.attention_eff)
    attn_re = attn_fwd if len(again) == len(linears) else 0.0  # per-op policy saves the attention output

    residual = residual_bytes(train, mesh)
    compiled = train.compile != "none"
    per_block = block_forward_bytes(model, train, mesh, compiled, residual)
    elementwise = memory_s(sum(per_block.values()) * tokens, c.hbm_bw)
    moe = share.moe_blocks
    if moe:  # MoE blocks: the routed and shared experts' GEMMs and memory-bound ops in place of the SwiGLU MLP's
        moe_fwd, moe_bwd = _moe_block_s(model, mesh, c, tokens, linears)
        sparse = {**per_block, **moe_forward_bytes(model, train, mesh)}
        fwd_mm, bwd_mm = _mixed(fwd_mm, moe_fwd, blocks, moe), _mixed(bwd_mm, moe_bwd, blocks, moe)
        re_mm = _mixed(re_mm, moe_fwd if len(again) == len(linears) else re_mm, blocks, moe)
        elementwise = _mixed(elementwise, memory_s(sum(sparse.values()) * tokens, c.hbm_bw), blocks, moe)
    head = memory_s(head_bytes(model, train, mesh, train.compiled_loss, residual) * tokens, c.hbm_bw)
    head = head if share.head else 0.0
    params_local = params_per_rank(model, mesh, share)
    gathered = gathered_params(model, mesh, share) if moe else None
    casts = memory_s(weight_cast_bytes(model, train, mesh, params_local, gathered), c.hbm_bw)
    forward = {
        "matmul": blocks * fwd_mm + head_mm,
        "attention": blocks * attn_fwd,
        "memory-bound": blocks * elementwise + head / (1 + BACKWARD_FACTOR),
        "casts": casts / 2,
    }
    backward = {
        "matmul": blocks * bwd_mm + head_bwd_mm,
        "attention": blocks * ATTENTION_BACKWARD * attn_fwd,
        "memory-bound": blocks * BACKWARD_FACTOR * elementwise + head * BACKWARD_FACTOR / (1 + BACKWARD_FACTOR),
        "recompute": recomputed * (re_mm + attn_re + elementwise),
        "casts": casts / 2,
    }
    per_step = {"optimizer": memory_s(optimizer_bytes(params_local), c.hbm_bw)}
    return ComputeTime(
        forward, backward, per_step, blocks * attn_fwd, blocks * ATTENTION_BACKWARD * attn_fwd + recomputed * attn_re
    )


def compute_time(model: ModelSpec, train: TrainingSpec, mesh: MeshShape, cluster: ClusterSpec) -> ComputeTime:
    """One rank's compute (``train`` already cut into the pipeline's micro-batches); with pp: the pp rank that
    computes longest (it sets the pace)."""
    times = [_share_time(model, train, mesh, cluster, share) for share in rank_shares(model, mesh)]
    return max(times, key=lambda t: t.forward_s + t.backward_s)
