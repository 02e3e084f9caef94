"""Step time: compute from FLOPs at an assumed MFU (or by kind, ``compute``), plus the communication that compute
cannot hide (the overlap rules: ``overlap``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndparallel.estimate.cluster import ClusterSpec
from ndparallel.estimate.comm import Collective
from ndparallel.estimate.compute import compute_time
from ndparallel.estimate.memory import checkpointed_blocks, pipeline_train
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.overlap import StepCompute, exposed_comm
from ndparallel.estimate.pipeline import bubble_fraction, microbatches, rank_shares
from ndparallel.estimate.training import TrainingSpec

__all__ = ["StepTime", "estimate_step_time"]


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, and the throughput that follows."""

    compute_s: float
    """Forward + backward (+ recompute) of all micro-batches at ``peak x mfu``."""
    comm_s: float
    """All communication, as if nothing overlapped."""
    exposed_s: dict[str, float]
    """Communication compute did not hide, per phase."""
    tokens_per_step: int
    model_flops_per_step: float
    world_size: int
    peak_flops: float
    bubble: float = 0.0
    """Pipeline parallel: idle share of the step (``compute_s`` already includes it)."""
    compute_by_kind: dict[str, float] = field(default_factory=dict)
    """Seconds per step of each kind of compute (matmul, attention, memory-bound, recompute, casts, optimizer),
    before the bubble: ``compute_s = sum + bubble_s``."""
    bubble_s: float = 0.0
    """Pipeline parallel: the seconds the bubble adds."""

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.exposed_s.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        """Achieved model FLOPs utilisation including exposed communication."""
        return self.model_flops_per_step / (self.step_s * self.world_size * self.peak_flops)

    def as_dict(self) -> dict[str, object]:
        return {
            "step_s": self.step_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s, "exposed_s": dict(self.exposed_s), "bubble": self.bubble,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "compute_by_kind": dict(self.compute_by_kind),
            "bubble_s": self.bubble_s,
        }  # fmt: skip


def estimate_step_time(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, cluster: ClusterSpec, comms: list[Collective]
) -> StepTime:
    """Compute time and exposed communication of one optimizer step (the rules: :mod:`ndparallel.estimate.overlap`)."""
    train = pipeline_train(train, mesh)
    micro_steps = train.accumulation_steps(mesh) or 1
    seq = train.seq_len
    flops_per_token = model.flops_per_token(seq)
    if cluster.mfu is not None:
        forward_s, backward_s, attention_s = _flat_compute(model, train, mesh, cluster, micro_steps)
        by_kind, per_step_s = {"matmul + attention (flat --mfu)": forward_s + backward_s}, 0.0
    else:
        parts = compute_time(model, train, mesh, cluster)
        forward_s, backward_s = micro_steps * parts.forward_s, micro_steps * parts.backward_s
        attention_s = micro_steps * (parts.attention_forward + parts.attention_backward)
        by_kind, per_step_s = parts.step_by_kind(micro_steps), sum(parts.per_step.values())

    compute = StepCompute(forward_s, backward_s, attention_s, per_step_s)
    bubble = bubble_fraction(mesh, microbatches(train, mesh))
    tokens_per_step = train.global_batch * seq
    return StepTime(
        compute_s=compute.total_s(bubble),
        comm_s=sum(row.time_s for row in comms),
        exposed_s=exposed_comm(compute, comms, mesh, train),
        tokens_per_step=tokens_per_step,
        model_flops_per_step=tokens_per_step * flops_per_token,
        world_size=mesh.world_size,
        peak_flops=cluster.peak_flops,
        bubble=bubble,
        compute_by_kind=by_kind,
        bubble_s=(forward_s + backward_s) * bubble / (1 - bubble),
    )


def _flat_compute(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, cluster: ClusterSpec, micro_steps: int
) -> tuple[float, float, float]:
    """The ``--mfu`` override: every FLOP at ``peak x mfu`` (forward, backward + recompute, attention)."""
    seq = train.seq_len
    tokens = train.micro_batch * seq  # per data-parallel rank and micro-batch, shared by its cp x tp ranks
    flops_per_token = model.flops_per_token(seq)
    attention_per_token = model.attention_flops_per_token(seq)
    layer_matmul_per_token = 6 * _active_matmul(model, model.n_layers, model.n_moe_layers)
    recomputed = checkpointed_blocks(model.n_layers, train.activation_checkpointing, train.selective_ac_option)
    # Recompute = one more forward (1/3 of forward + backward) of the checkpointed blocks.
    recompute_per_token = recomputed / model.n_layers * (layer_matmul_per_token + attention_per_token) / 3
    # one dp rank's cp x tp GPUs share its tokens; with pp each computes its stages' share (the largest sets the pace)
    rate = cluster.peak_flops * float(cluster.mfu or 1.0) * mesh.cp * mesh.tp / _largest_share(model, mesh)
    forward_s = micro_steps * tokens * flops_per_token / 3 / rate
    backward_s = micro_steps * tokens * (2 * flops_per_token / 3 + recompute_per_token) / rate
    attention_s = micro_steps * tokens * attention_per_token * (1 + recomputed / model.n_layers / 3) / rate
    return forward_s, backward_s, attention_s


def _largest_share(model: ModelSpec, mesh: MeshShape) -> float:
    """The largest fraction of the model's matmul FLOPs one pp rank computes (1 without pp)."""
    if mesh.pp == 1:
        return 1.0
    head = model.vocab_size * model.dim
    total = _active_matmul(model, model.n_layers, model.n_moe_layers) + head
    shares = rank_shares(model, mesh)
    return max((_active_matmul(model, s.blocks, s.moe_blocks) + s.head * head) / total for s in shares)


def _active_matmul(model: ModelSpec, blocks: int, moe_blocks: int) -> int:
    """Matmul weights a token runs through in ``blocks`` blocks, ``moe_blocks`` of them MoE (``top_k`` experts)."""
    return (blocks - moe_blocks) * model.layer_matmul_params + moe_blocks * model.moe_matmul_params(model.top_k)
