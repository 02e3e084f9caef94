"""The mixture-of-experts part of the cost model: where a block's routed experts live on a mesh, what an MoE
block saves for backward, runs and moves. It mirrors the runtime (``ndparallel/parallel/expert_parallel.py``,
``moe_tensor_parallel.py`` and the ``Mesh``'s experts views); formulas and their measured validation:
docs/planning.md ("Mixture of experts").

Layout: ``ep`` borrows the inner ``ep`` ranks of dp_shard x cp, each owning ``n_experts / ep`` experts (dim 0 of
the stacked weights ``[E, F, d]``), their hidden width ``F`` split over tp. Each MoE block's experts are an FSDP
unit of their own over ``ep_fsdp = dp_shard x cp / ep`` (with ep 1 they sit in the block's unit, over dp_shard x
cp). FSDP2 shards dim 0 and pads it to ``ceil(rows / ranks)`` rows a rank, so more ranks than experts cost each
rank a whole expert. The router's gate ``[E, d]`` (replicated over tp) is padded the same way in its block's unit
over dp_shard x cp. The rest of an MoE block (attention, norms, the shared experts) is sharded as a dense block's.

Per MoE block and micro-batch of ``T`` tokens a rank (its sequence shard, all-gathered over tp): the router counts
its tokens per expert and all-reduces them over dp x cp (fp64, the global batch's balancing statistics); under
ep the counts go to the experts' owners (one int64 all-to-all), the ``T k`` routed rows go out and come back
(two all-to-alls forward, two backward). A rank sends exactly ``T k`` rows on dispatch; what it receives depends
on the routing, and its mean over the ep group is ``T k``: the payload below is that mean.
"""

from __future__ import annotations

import math

from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.training import TrainingSpec

__all__ = [
    "expert_elements",
    "expert_gemms",
    "expert_rows",
    "gathered_expert_elements",
    "gathered_router_elements",
    "moe_block_params",
    "moe_collectives",
    "moe_ffn_activation_bytes_per_token",
    "moe_forward_bytes",
    "router_rows",
    "stored_expert_elements",
    "stored_router_elements",
]

COUNT_BYTES = 8
"""Tokens per expert travel as int64 (the all-to-all of counts) and are summed in float64 (the router statistics)."""


def expert_elements(model: ModelSpec, tp: int) -> float:
    """One routed expert's w1, w3, w2 on one tensor-parallel rank (its hidden width split over tp): ``3 d F / t``."""
    return model.expert_params / tp


def expert_rows(model: ModelSpec, mesh: MeshShape) -> int:
    """Experts (dim-0 rows of the stacked weights) one rank stores per MoE block: its ``n_experts / ep``, sharded by
    FSDP2 over ``ep_fsdp`` ranks and padded to ``ceil(rows / ranks)``."""
    return math.ceil(model.n_experts // mesh.ep / mesh.ep_fsdp)


def stored_expert_elements(model: ModelSpec, mesh: MeshShape) -> float:
    """Routed-expert elements one rank stores per MoE block (its FSDP shard, padding included)."""
    return expert_rows(model, mesh) * expert_elements(model, mesh.tp)


def gathered_expert_elements(model: ModelSpec, mesh: MeshShape) -> float:
    """Routed-expert elements of one MoE block a rank holds while its experts' unit is all-gathered (its ``n_experts
    / ep`` experts, padding included): the all-gather's output, the reduce-scatter's input."""
    return expert_rows(model, mesh) * mesh.ep_fsdp * expert_elements(model, mesh.tp)


def router_rows(model: ModelSpec, mesh: MeshShape) -> int:
    """Rows of the router's gate ``[E, d]`` one rank stores: sharded by its block's FSDP over dp_shard x cp, padded
    to ``ceil(E / ranks)``."""
    return math.ceil(model.n_experts / mesh.fsdp)


def stored_router_elements(model: ModelSpec, mesh: MeshShape) -> float:
    """The router gate's elements one rank stores per MoE block (padding included)."""
    return router_rows(model, mesh) * model.dim


def gathered_router_elements(model: ModelSpec, mesh: MeshShape) -> float:
    """The router gate's elements in its block's all-gathered unit (padding included)."""
    return router_rows(model, mesh) * mesh.fsdp * model.dim


def moe_block_params(model: ModelSpec, tp: int) -> float:
    """One MoE block's elements FSDP shards evenly on one tp rank: attention and shared experts split over tp, the
    norms (its router and routed experts, whose small dim 0 FSDP2 pads, are apart)."""
    return (model.attention_params + model.shared_params) / tp + model.layer_norm_params


def moe_ffn_activation_bytes_per_token(model: ModelSpec, train: TrainingSpec, tp: int) -> float:
    """What an MoE block's feed-forward saves for backward per token of the block (in place of the dense SwiGLU's
    ``4 e f / t``), measured tensor by tensor with saved-tensor hooks (tests/estimate/test_experts.py).

    Per routed row (``top_k`` a token): the experts' SwiGLU ``4 e F / t``; the rows the experts read, their
    outputs and the weighted outputs ``index_add`` reads (``3 e d``: whole tokens, all-gathered under tp); the
    routing weight in the compute dtype and, fp32 / int64, its weight and three indices (``e + 28``). Per token:
    the router's fp32 probabilities and logits (``8 E``), their log-sum-exp and the weights' sum (8); the shared
    experts' SwiGLU ``4 e S / t``. Under ep the rows an owner keeps depend on the routing; their mean over the ep
    group is the same ``T k``."""
    e, t, k = train.bytes.compute, tp, model.top_k
    routed = k * (4 * e * model.expert_ffn_dim / t + 3 * e * model.dim + e + 28)
    return routed + 8 * model.n_experts + 8 + 4 * e * model.shared_ffn_dim / t


def expert_gemms(model: ModelSpec, mesh: MeshShape, tokens: float) -> list[tuple[float, float, float, int]]:
    """``(rows, in, out, count)`` of an MoE block's matmuls outside attention on one rank, for ``tokens`` tokens:
    the router's gate, the shared experts, and each local expert's three projections on its share of the ``T k``
    routed rows (balanced routing: ``T k ep / E`` rows for each of its ``E / ep`` experts)."""
    d, t = model.dim, mesh.tp
    local = model.n_experts // mesh.ep
    rows = tokens * model.top_k / local if local else 0.0
    f, s = model.expert_ffn_dim / t, model.shared_ffn_dim / t
    gemms = [(tokens, d, model.n_experts, 1)]
    if s:
        gemms += [(tokens, d, s, 2), (tokens, s, d, 1)]
    return gemms + [(rows, d, f, 2 * local), (rows, f, d, local)]


def moe_forward_bytes(model: ModelSpec, train: TrainingSpec, mesh: MeshShape) -> dict[str, float]:
    """Bytes per token of an MoE block's memory-bound forward ops (in place of the dense ``swiglu``): the routed
    and shared SwiGLUs (``5 e`` per hidden element, as the dense one); the routing copies of ``d``-wide rows, ``k``
    a token (gather, sort by expert on the owner and back, the weighting, ``index_add``: ``9 e d k + 2 e d``); the
    router's softmax and top-k over ``E`` fp32 logits (``16 E``). Not measured on hardware."""
    e, k, d = train.bytes.compute, model.top_k, model.dim
    return {
        "swiglu": 5 * e * (k * model.expert_ffn_dim + model.shared_ffn_dim) / mesh.tp,
        "moe routing": (9 * k + 2) * e * d + 16 * model.n_experts,
    }


Row = tuple[str, str, tuple[str, ...], str, int, float]


def moe_collectives(
    model: ModelSpec, train: TrainingSpec, moe_blocks: int, tokens: float, micro_steps: int, grad_bytes: int
) -> list[Row]:
    """``(name, kind, dims, phase, calls, payload)`` of an MoE step's own collectives on one rank: ``moe_blocks``
    blocks, ``tokens`` per micro-batch, ``micro_steps`` micro-batches (the experts' FSDP rows are ``comm``'s).

    The router's tokens per expert, all-reduced over dp x cp (``dims`` ``("dp_cp",)``); under ep the counts'
    all-to-all and the routed rows' four (dispatch and combine, forward and backward: ``4 T k d e``, the mean
    over the ep group); under tp the router gate's gradient, a Partial sum over tp all-reduced once per
    micro-batch in the unsharded gradient's dtype ``grad_bytes`` (measured: bf16 under FSDP's bf16 policy)."""
    calls = moe_blocks * micro_steps
    counts = COUNT_BYTES * model.n_experts
    rows = tokens * model.top_k * model.dim * train.bytes.compute
    return [
        ("EP all-to-all (routed tokens)", "all_to_all", ("ep",), "ep", 4 * calls, 4 * calls * rows),
        ("EP all-to-all (tokens per expert)", "all_to_all", ("ep",), "ep", calls, calls * counts),
        ("Router all-reduce (tokens per expert)", "all_reduce", ("dp_cp",), "ep", calls, calls * counts),
        ("TP all-reduce (router weight grads)", "all_reduce", ("tp",), "tp", calls,
         calls * model.router_params * grad_bytes),
    ]  # fmt: skip
