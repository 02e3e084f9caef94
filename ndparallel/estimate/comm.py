"""Per-step communication of one rank: every collective, its mesh dim, link, bytes and time.

Bytes are *payloads*: the full tensor of an all-gather's output, a reduce-scatter's input, an
all-reduce's tensor, a P2P send's tensor (what ``CommCounter`` counts on real ranks). Time uses the
ring algorithm: a rank moves ``(n-1)/n`` of the payload for all-gather and reduce-scatter and
``2(n-1)/n`` for all-reduce, at the link's efficiency times the data-sheet bandwidth of the slowest link the
group crosses, plus a fixed latency per call (``hardware.LINKS``: so a small message reaches a small fraction
of the bandwidth, ``size / (size + latency x bandwidth)``). Which link a group uses follows from the mesh order
(dp_replicate, dp_shard, cp, tp, outer -> inner): a group whose ranks fit inside one node uses NVLink, otherwise
the network. Expert parallelism's groups are cut out of dp_shard x cp: ``ep`` its inner ranks (``ep x tp``
consecutive ones), ``ep_fsdp`` the rest (spread over the whole of dp_shard x cp); ``dp_cp`` is dp x cp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ndparallel.config.dims import FSDP_DIMS
from ndparallel.distributed.ulysses import kv_heads_sent
from ndparallel.estimate.checkpointing import per_op
from ndparallel.estimate.cluster import ClusterSpec
from ndparallel.estimate.experts import (
    gathered_expert_elements,
    gathered_router_elements,
    moe_block_params,
    moe_collectives,
)
from ndparallel.estimate.hardware import LINKS
from ndparallel.estimate.memory import (
    DDP_BUCKET_BYTES,
    checkpointed_blocks,
    dense_params,
    gathered_params,
    params_per_rank,
    pipeline_train,
    residual_bytes,
)
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.pipeline import RankShare, microbatches, p2p_sends, rank_shares
from ndparallel.estimate.training import TrainingSpec

__all__ = ["LATENCY_S", "Collective", "collectives", "group_link", "group_size"]

DIM_ORDER = ("dp_replicate", "dp_shard", "cp", "tp")
LATENCY_S = {name: link.latency_s for name, link in LINKS.items()}
"""Fixed cost of one collective call (launch + synchronisation), seconds (``hardware.LINKS``)."""
BUS_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "send_recv": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


@dataclass(frozen=True)
class Collective:
    """One kind of collective call in a training step, summed over its calls."""

    name: str
    kind: str
    """all_gather, reduce_scatter, all_reduce, send_recv, all_to_all or broadcast."""
    group: str
    """Mesh dim or view it runs over: dp_shard_cp, dp_replicate, tp, cp, pp; ep, ep_fsdp, dp_cp (mixture of
    experts)."""
    group_size: int
    phase: str
    """What it can overlap with: fsdp_forward, fsdp_backward, grad_reduce, tp, cp and ep (on the critical path),
    cp_ring (hidden behind attention), pp (point-to-point between stages), loss (the pipeline's loss, after the
    schedule: on the critical path), after_schedule (pure replicate under pp: the gradient all-reduce after
    the schedule, on the critical path)."""
    calls: int
    """Calls per optimizer step."""
    payload_bytes: float
    """Sum of payloads over the step's calls."""
    link: str
    """intra (NVLink) or inter (network)."""
    bandwidth: float

    @property
    def bus_bytes(self) -> float:
        """Bytes each rank sends over the step (ring algorithm)."""
        return self.payload_bytes * BUS_FACTOR[self.kind](self.group_size)

    @property
    def time_s(self) -> float:
        link = LINKS[self.link]
        return self.bus_bytes / (self.bandwidth * link.efficiency) + self.calls * link.latency_s

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "bus_bytes": self.bus_bytes, "time_s": self.time_s}


def group_link(mesh: MeshShape, dims: tuple[str, ...], cluster: ClusterSpec) -> str:
    if dims == ("pp",):  # pp is outermost: a stage's neighbour is inner_size ranks away
        return "intra" if mesh.world_size <= cluster.gpus_per_node else "inter"
    if dims == ("ep",):  # the inner ep ranks of dp_shard x cp: ep x tp consecutive ranks
        return "intra" if mesh.ep * mesh.tp <= cluster.gpus_per_node else "inter"
    if dims == ("ep_fsdp",):  # strided over the whole of dp_shard x cp
        return _inner_link(mesh, ("dp_shard", "cp"), cluster)
    if dims == ("dp_cp",):
        return _inner_link(mesh, ("dp_replicate", "dp_shard", "cp"), cluster)
    return _inner_link(mesh, dims, cluster)


def group_size(mesh: MeshShape, dims: tuple[str, ...]) -> int:
    """Ranks of one group over ``dims`` (a mesh dim, several contiguous ones, or ``pp`` / ``ep`` / ``ep_fsdp`` /
    ``dp_cp``)."""
    dp_cp = mesh.dp_replicate * mesh.fsdp
    special = {("pp",): mesh.pp, ("ep",): mesh.ep, ("ep_fsdp",): mesh.ep_fsdp, ("dp_cp",): dp_cp}
    if dims in special:
        return special[dims]
    return math.prod(mesh.as_dict()[d] for d in dims)


def _inner_link(mesh: MeshShape, dims: tuple[str, ...], cluster: ClusterSpec) -> str:
    """``intra`` if every group over ``dims`` (contiguous in mesh order) lies inside one node, else ``inter``.

    Ranks are laid out row-major over (dp_replicate, dp_shard, cp, tp) and placed on nodes in rank
    order, so a group spans ``stride x size`` consecutive ranks, stride = product of the inner dims.
    """
    sizes = mesh.as_dict()
    inner = DIM_ORDER[DIM_ORDER.index(dims[-1]) + 1 :]
    stride = math.prod(sizes[d] for d in inner)
    span = stride * math.prod(sizes[d] for d in dims)
    return "intra" if span <= cluster.gpus_per_node else "inter"


def collectives(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, cluster: ClusterSpec, pp_rank: int | None = None
) -> list[Collective]:
    """Every collective of one optimizer step on one rank (see docs/planning.md for each row). With pp: on
    ``pp_rank``, or (None) on the pp rank whose communication takes longest."""
    if mesh.pp > 1 and pp_rank is None:
        per_rank = [collectives(model, train, mesh, cluster, r) for r in range(mesh.pp)]
        return max(per_rank, key=lambda rows: sum(row.time_s for row in rows))
    share = rank_shares(model, mesh)[pp_rank or 0]
    train = pipeline_train(train, mesh)
    micro_steps = train.accumulation_steps(mesh) or 1
    precision = train.bytes
    layers = share.blocks
    rows: list[Collective] = []

    def add(name: str, kind: str, dims: tuple[str, ...], phase: str, calls: int, payload: float) -> None:
        size = group_size(mesh, dims)
        if size == 1 or calls == 0:
            return
        link = group_link(mesh, dims, cluster)
        bandwidth = cluster.intra_node_bw if link == "intra" else cluster.inter_node_bw
        group = "dp_shard_cp" if dims == ("dp_shard", "cp") else dims[0]
        rows.append(Collective(name, kind, group, size, phase, calls, payload, link, bandwidth))

    # FSDP2 over dp_shard x cp: units = embedding, n_layers blocks, head (final norm + output); under ep each MoE
    # block's experts are a unit of their own over ep_fsdp.
    n_units = layers + share.embedding + share.head
    expert_units = share.moe_blocks if mesh.ep > 1 else 0
    if mesh.pp > 1:
        _pipeline_fsdp_rows(add, model, train, mesh, share)
    else:
        _fsdp_rows(add, model, train, mesh, share)

    # Data-parallel replicas: HSDP all-reduces the gradient shards, plain replicate whole bucketed gradients.
    replicated = params_per_rank(model, mesh, share) * precision.reduce
    if mesh.fsdp > 1:
        add("HSDP all-reduce (grad shards)", "all_reduce", ("dp_replicate",), "grad_reduce",
            n_units + expert_units, replicated)  # fmt: skip
    elif mesh.pp > 1:
        # Pipeline.step runs the schedule under no_sync, then all-reduces every gradient of the rank's stages
        # as one flat tensor (ndparallel/parallel/pipeline/runtime.py, _average_replicas): once per step, after the
        # schedule.
        add("replicate all-reduce (grads, after the schedule)", "all_reduce", ("dp_replicate",), "after_schedule",
            1, replicated)  # fmt: skip
    else:
        buckets = max(1, math.ceil(replicated / DDP_BUCKET_BYTES))
        add("replicate all-reduce (grads)", "all_reduce", ("dp_replicate",), "grad_reduce",
            buckets, replicated)  # fmt: skip

    # Tensor parallel with sequence parallel: per block 2 all-gathers + 2 reduce-scatters of the
    # [micro_batch, seq/cp, dim] activation forward, the same again backward, + recomputed forwards.
    tokens = train.micro_batch * train.seq_len / mesh.cp
    activation = tokens * model.dim * precision.compute
    recomputed = checkpointed_blocks(layers, train.activation_checkpointing, train.selective_ac_option)
    # Recomputation (non-reentrant checkpoint) stops once the last saved tensor is rebuilt: the block's
    # final reduce-scatter (w2's) is not repeated. + 1 each for the embedding (reduce-scatter forward,
    # all-gather backward) and the output projection (all-gather forward, reduce-scatter backward).
    ends = share.embedding + share.head
    # Per-op selective checkpointing saves the reduce-scatter outputs: only the all-gathers run again.
    rs_recomputed = 0 if per_op(train.activation_checkpointing, train.selective_ac_option) else recomputed
    tp_calls = {"all_gather": 4 * layers + 2 * recomputed + ends, "reduce_scatter": 4 * layers + rs_recomputed + ends}
    for kind, calls in tp_calls.items():
        add(f"TP {kind.replace('_', '-')} (SP activations)", kind, ("tp",), "tp",
            calls * micro_steps, calls * activation * micro_steps)  # fmt: skip
    norms = 2 * layers + share.head
    # Once per micro-batch, pp included: the first by the gradient's hook, each later one when its Partial
    # gradient is added to the Replicate one (counted through ndparallel.parallel.pipeline:
    # tests/estimate/test_pipeline.py). In the dtype the norm ran in: the compute dtype under FSDP's
    # policy (before FSDP's reduce-scatter casts to fp32), fp32 under autocast, like a router gate's below.
    unsharded_grad_bytes = residual_bytes(train, mesh)
    add("TP all-reduce (norm weight grads)", "all_reduce", ("tp",), "tp",
        norms * micro_steps, norms * model.dim * unsharded_grad_bytes * micro_steps)  # fmt: skip
    if share.head:  # loss_parallel: cross-entropy over vocab-sharded logits all-reduces max, sum-exp, target logit
        add("TP all-reduce (loss-parallel stats)", "all_reduce", ("tp",), "tp",
            3 * micro_steps, 3 * tokens * 4 * micro_steps)  # fmt: skip

    for row in _context_parallel(model, train, mesh, tokens, recomputed, layers):
        add(*row[:3], "cp_ring" if train.cp_rotate_method == "ring" else "cp", *row[3:])
    if share.moe_blocks:
        for row in moe_collectives(model, train, share.moe_blocks, tokens, micro_steps, unsharded_grad_bytes):
            add(*row)
    if mesh.pp > 1:
        activation = tokens * model.dim * residual_bytes(train, mesh) / mesh.tp
        _pipeline_rows(add, train, mesh, share, activation, model.is_moe)
    return rows


def _fsdp_gathered(model: ModelSpec, mesh: MeshShape, share: RankShare) -> tuple[float, float]:
    """(elements of the share's units over dp_shard x cp, of its experts' own units over ep_fsdp) once gathered:
    with ep 1 the experts sit in their block's unit."""
    if mesh.ep > 1 and share.moe_blocks:
        routers = share.moe_blocks * gathered_router_elements(model, mesh)
        return dense_params(model, mesh.tp, share) + routers, share.moe_blocks * gathered_expert_elements(model, mesh)
    return gathered_params(model, mesh, share), 0.0


def _last_block(model: ModelSpec, mesh: MeshShape) -> float:
    """Elements of the last block's unit (over dp_shard x cp), which stays gathered from forward into backward."""
    if model.n_layers - 1 not in model.moe_layers:
        return model.layer_matmul_params / mesh.tp + model.layer_norm_params
    experts = gathered_expert_elements(model, mesh) if mesh.ep == 1 else 0.0
    return moe_block_params(model, mesh.tp) + gathered_router_elements(model, mesh) + experts


def _fsdp_rows(add, model: ModelSpec, train: TrainingSpec, mesh: MeshShape, share: RankShare) -> None:  # noqa: ANN001
    """FSDP2 without pp: all-gather every unit per micro-batch forward, again in backward when resharding (the last
    block's unit excepted, not the experts'), and reduce-scatter on every micro-batch that syncs."""
    micro_steps = train.accumulation_steps(mesh) or 1
    rs_steps = train.reduce_scatter_steps(mesh)  # HSDP's all-reduce and replicate's: once per step
    precision, fsdp = train.bytes, FSDP_DIMS
    n_units = share.blocks + share.embedding + share.head
    gathered, experts = _fsdp_gathered(model, mesh, share)
    add("FSDP all-gather (forward)", "all_gather", fsdp, "fsdp_forward",
        n_units * micro_steps, gathered * precision.compute * micro_steps)  # fmt: skip
    if train.reshard_after_forward:  # the last block stays gathered into backward (parallel/fully_shard.py)
        block = _last_block(model, mesh)
        add("FSDP all-gather (backward)", "all_gather", fsdp, "fsdp_backward",
            (n_units - 1) * micro_steps, (gathered - block) * precision.compute * micro_steps)  # fmt: skip
    add("FSDP reduce-scatter (grads)", "reduce_scatter", fsdp, "grad_reduce",
        n_units * rs_steps, gathered * precision.reduce * rs_steps)  # fmt: skip
    if not experts:
        return
    units, ep_fsdp = share.moe_blocks, ("ep_fsdp",)
    passes = 2 if train.reshard_after_forward else 1
    for phase, name in (("fsdp_forward", "forward"), ("fsdp_backward", "backward"))[:passes]:
        add(f"FSDP all-gather (experts, {name})", "all_gather", ep_fsdp, phase,
            units * micro_steps, experts * precision.compute * micro_steps)  # fmt: skip
    add("FSDP reduce-scatter (expert grads)", "reduce_scatter", ep_fsdp, "grad_reduce",
        units * rs_steps, experts * precision.reduce * rs_steps)  # fmt: skip


def _pipeline_fsdp_rows(add, model: ModelSpec, train: TrainingSpec, mesh: MeshShape, share: RankShare) -> None:  # noqa: ANN001
    """FSDP2 under pp: the schedule keeps units gathered for the whole step and syncs gradients after the last
    micro-batch: one all-gather and one reduce-scatter per unit (the experts' own units over ep_fsdp)."""
    precision, fsdp = train.bytes, FSDP_DIMS
    n_units = share.blocks + share.embedding + share.head
    gathered, experts = _fsdp_gathered(model, mesh, share)
    add("FSDP all-gather (once per step)", "all_gather", fsdp, "fsdp_forward", n_units, gathered * precision.compute)
    add("FSDP reduce-scatter (grads)", "reduce_scatter", fsdp, "grad_reduce", n_units, gathered * precision.reduce)
    if experts:
        units = share.moe_blocks
        add("FSDP all-gather (experts, once per step)", "all_gather", ("ep_fsdp",), "fsdp_forward",
            units, experts * precision.compute)  # fmt: skip
        add("FSDP reduce-scatter (expert grads)", "reduce_scatter", ("ep_fsdp",), "grad_reduce",
            units, experts * precision.reduce)  # fmt: skip


def _pipeline_rows(
    add: Callable[..., None], train: TrainingSpec, mesh: MeshShape, share: RankShare, activation: float, moe: bool
) -> None:
    """Point-to-point between stages: per micro-batch each stage sends its output ([mb, seq/(cp tp), dim], the
    sequence-parallel shard, in the residual stream's dtype) forward and its input's gradient backward (same size).
    Then the step's reported loss, and an MoE's aux losses, one float64 each."""
    forward, backward = p2p_sends(mesh, microbatches(train, mesh), share)
    add("PP send (activations)", "send_recv", ("pp",), "pp", forward, forward * activation)
    add("PP send (activation grads)", "send_recv", ("pp",), "pp", backward, backward * activation)
    # The step's loss: averaged over dp x cp where the last stage is, then broadcast over pp.
    if share.head:
        add("PP loss all-reduce (dp x cp)", "all_reduce", ("dp_cp",), "loss", 1, 8)
    add("PP loss broadcast", "broadcast", ("pp",), "loss", 1, 8)
    if moe:  # every stage's aux losses: summed over pp, then averaged over dp x cp (parallel/pipeline/runtime.py)
        add("PP aux-loss all-reduce", "all_reduce", ("pp",), "loss", 1, 8)
        add("PP aux-loss all-reduce (dp x cp)", "all_reduce", ("dp_cp",), "loss", 1, 8)


def _context_parallel(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, tokens: float, recomputed: int, layers: int
) -> list[tuple[str, str, tuple[str, ...], int, float]]:
    """(name, kind, dims, calls, payload) of the cp collectives of one micro-batch x micro-batches, per method.

    ``tokens``: this rank's tokens per micro-batch. Per block: ``ring`` (distributed/ring.py) sends the local K and V
    (kv heads, compute dtype) cp-1 hops forward and again in backward, and the fp32 dK/dV partial sums cp hops;
    ``allgather`` gathers K/V forward and again in backward and reduce-scatters the fp32 dK/dV; ``alltoall``
    (distributed/ulysses.py) sends q/k/v in and the output back forward, the output's gradient in and dq/dk/dv back
    in backward, with kv heads repeated to ``lcm(kv heads, cp)`` when cp does not divide them. A recomputed
    (checkpointed) block repeats its forward communication.
    """
    micro_steps = train.accumulation_steps(mesh) or 1
    e, cp = train.bytes.compute, mesh.cp
    kv = 2 * tokens * model.kv_dim / mesh.tp  # K and V elements of this rank's tokens
    forward_passes = layers + recomputed
    if train.cp_rotate_method == "ring":
        hops = (forward_passes + layers) * (cp - 1)
        return [
            ("CP ring K/V send/recv", "send_recv", ("cp",), hops * micro_steps, hops * kv * e * micro_steps),
            ("CP ring dK/dV send/recv", "send_recv", ("cp",), layers * cp * micro_steps,
             layers * cp * kv * 4 * micro_steps),
        ]  # fmt: skip
    if train.cp_rotate_method == "allgather":
        gathers = forward_passes + layers
        return [
            ("CP all-gather K/V", "all_gather", ("cp",), gathers * micro_steps, gathers * cp * kv * e * micro_steps),
            ("CP reduce-scatter dK/dV", "reduce_scatter", ("cp",), layers * micro_steps,
             layers * cp * kv * 4 * micro_steps),
        ]  # fmt: skip
    q = tokens * model.q_dim / mesh.tp
    kv_sent = 2 * tokens * kv_heads_sent(model.n_kv_heads // mesh.tp, cp) * model.head_dim
    passes = forward_passes + layers  # each pass: one all-to-all of q/k/v-sized data, one of q-sized data
    return [
        ("CP all-to-all (q/k/v and output)", "all_to_all", ("cp",), 2 * passes * micro_steps,
         passes * (2 * q + kv_sent) * e * micro_steps),
    ]  # fmt: skip
