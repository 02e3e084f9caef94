"""Estimate one mesh shape, and search every mesh shape of a world size, ranked by predicted step time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ndparallel import pp_rules
from ndparallel.config import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.estimate.comm import Collective, collectives
from ndparallel.estimate.memory import MemoryEstimate, estimate_memory, precision_problem
from ndparallel.estimate.pipeline import microbatches
from ndparallel.estimate.spec import ClusterSpec, GiB, MeshShape, ModelSpec, TrainingSpec
from ndparallel.estimate.timing import StepTime, estimate_step_time
from ndparallel.sequence import sequence_problem

__all__ = ["Estimate", "Plan", "estimate", "mesh_shapes", "plan", "shape_problems"]


@dataclass(frozen=True)
class Estimate:
    """Everything predicted for one mesh shape."""

    mesh: MeshShape
    memory: MemoryEstimate
    comms: list[Collective]
    time: StepTime
    usable_memory: float
    problems: list[str] = field(default_factory=list)
    """Why the shape is invalid (divisibility); empty when valid."""
    microbatches: int = 1
    """Micro-batches per step on each data-parallel rank (the pipeline's m under pp)."""

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.usable_memory

    @property
    def feasible(self) -> bool:
        return self.valid and self.fits

    @property
    def headroom(self) -> float:
        return self.usable_memory - self.memory.peak

    @property
    def dominant_comm(self) -> Collective | None:
        return max(self.comms, key=lambda row: row.time_s, default=None)

    def reason(self) -> str:
        """One line: why this shape ranks where it does, or why it cannot run."""
        if self.problems:
            return "; ".join(self.problems)
        mem = self.memory
        if not self.fits:
            parts = {
                "state": mem.state, "activations": mem.activations, "transient": mem.transient,
                "unsharded grads (accumulation)": mem.accumulated_grads,
            }  # fmt: skip
            biggest = max(parts, key=parts.__getitem__)
            return (
                f"out of memory: needs {mem.peak / GiB:.1f} GiB > {self.usable_memory / GiB:.1f} GiB usable "
                f"(largest: {biggest} {parts[biggest] / GiB:.1f} GiB)"
            )
        text = f"headroom {self.headroom / GiB:.1f} GiB"
        if self.mesh.pp > 1:
            text += (
                f"; pp {self.mesh.pp} x {self.mesh.stages_per_rank} stage(s)/rank, m={self.microbatches}, "
                f"bubble {self.time.bubble:.0%}, peak on pp rank {self.memory.pp_rank}"
            )
        top = self.dominant_comm
        if top is None:
            return text + "; no communication"
        exposed = self.time.exposed_comm_s
        share = exposed / self.time.step_s
        return (
            f"{text}; most comm: {top.name} over {top.group}={top.group_size} ({top.link}) {top.time_s:.2f} s; "
            f"exposed comm {exposed:.2f} s ({share:.0%} of step)"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "mesh": {**self.mesh.as_dict(), **(self.mesh.pp_dict() if self.mesh.pp > 1 else {})},
            "microbatches": self.microbatches,
            "valid": self.valid,
            "fits": self.fits,
            "problems": list(self.problems),
            "reason": self.reason(),
            "memory": self.memory.as_dict(),
            "usable_memory": self.usable_memory,
            "time": self.time.as_dict(),
            "comms": [row.as_dict() for row in self.comms],
        }


def shape_problems(model: ModelSpec, train: TrainingSpec, mesh: MeshShape) -> list[str]:
    """Divisibility rules a mesh shape must satisfy for this model and batch (empty list = valid)."""
    problems = []
    for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):  # what the TP plan splits
        if getattr(model, name) % mesh.tp:
            problems.append(f"tp={mesh.tp} does not divide {name}={getattr(model, name)}")
            break
    if mesh.cp > 1 and train.cp_rotate_method == "alltoall" and (model.n_heads // mesh.tp) % mesh.cp:
        problems.append(
            f"cp={mesh.cp} does not divide n_heads / tp = {model.n_heads // mesh.tp} (alltoall splits heads)"
        )
    precision = precision_problem(train, mesh)  # the trainer's mixed-precision rule (fp16 needs FSDP)
    if precision:
        problems.append(precision)
    sequence = sequence_problem(train.seq_len, mesh.cp, mesh.tp, train.cp_load_balance, what="seq_len")
    if sequence:
        problems.append(sequence)
    per_step = mesh.dp * train.micro_batch
    if mesh.pp > 1:
        problems += pipeline_problems(model, train, mesh)
    elif train.global_batch % per_step:
        problems.append(
            f"global_batch={train.global_batch} not divisible by dp_replicate x dp_shard x micro_batch={per_step}"
        )
    return problems


def pipeline_problems(model: ModelSpec, train: TrainingSpec, mesh: MeshShape) -> list[str]:
    """Why a pp shape cannot run: the config's own validation (``ParallelismConfig`` with the pp fields and the
    training's precision and checkpointing: what ``ndparallel train`` refuses under pp, ``pp_rules``) and the
    schedule's micro-batch rule (``ndparallel.pp_rules.check_microbatches``); plus a block per stage at least
    and a batch that splits into m micro-batches (what the estimate needs). Every inner shape the
    config accepts is modelled (pp x dp_shard / cp / tp / pure dp_replicate: docs/planning.md)."""
    problems = []
    n_stages, local = mesh.pp * mesh.stages_per_rank, train.global_batch // mesh.dp
    m = microbatches(train, mesh)
    sizes = {f"{dim}_size": value for dim, value in mesh.as_dict().items()}
    knobs = {"pp_size": mesh.pp, "pp_schedule": mesh.pp_schedule, "pp_microbatches": mesh.pp_microbatches or None,
             "pp_stages_per_rank": mesh.pp_stages_per_rank or None,
             "mixed_precision": "no" if train.precision == "fp32" else train.precision,
             "activation_checkpointing": train.activation_checkpointing,
             "cp_rotate_method": train.cp_rotate_method, "cp_load_balance": train.cp_load_balance}  # fmt: skip
    try:
        ParallelismConfig(**sizes, **knobs).resolve(mesh.world_size)
    except ConfigError as err:
        problems.append(str(err))
    if n_stages > model.n_layers:
        problems.append(f"pp={mesh.pp} x {mesh.stages_per_rank} stage(s) per rank > {model.n_layers} blocks")
    if train.global_batch % mesh.dp or not m or local % m:
        problems.append(
            f"global_batch={train.global_batch} does not split over dp={mesh.dp} into pp_microbatches="
            f"{m or mesh.pp_microbatches or '(accumulation steps)'} micro-batches"
        )
    else:
        try:
            pp_rules.check_microbatches(mesh.pp_schedule, m, mesh.pp, mesh.stages_per_rank, "pp_microbatches")
        except ConfigError as err:
            problems.append(str(err))
    return problems


def estimate(model: ModelSpec, train: TrainingSpec, mesh: MeshShape, cluster: ClusterSpec | None = None) -> Estimate:
    """Memory, communication and step time of ``model`` trained with ``train`` on ``mesh``."""
    cluster = cluster or ClusterSpec(num_gpus=mesh.world_size)
    if mesh.world_size != cluster.num_gpus:
        raise ConfigError(
            f"mesh {mesh.describe()} has {mesh.world_size} ranks but the cluster has num_gpus={cluster.num_gpus}"
        )
    memory = estimate_memory(model, train, mesh)
    comms = collectives(model, train, mesh, cluster)
    time = estimate_step_time(model, train, mesh, cluster, comms)
    problems = shape_problems(model, train, mesh)
    micro = microbatches(train, mesh) if mesh.pp > 1 else train.accumulation_steps(mesh)
    return Estimate(mesh, memory, comms, time, cluster.usable_memory, problems, micro)


def mesh_shapes(
    world_size: int, fixed: Mapping[str, int] | None = None, pp_schedules: tuple[str, ...] = (), **pp_knobs: int
) -> list[MeshShape]:
    """Every (dp_replicate, dp_shard, cp, tp) whose product is ``world_size``; ``fixed`` pins dims (``pp`` too).
    With ``pp_schedules``, also every pp > 1 dividing the world, once per schedule (``pp_knobs``:
    ``pp_microbatches``, ``pp_stages_per_rank``)."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - {*MeshShape().as_dict(), "pp"})
    if unknown:
        raise ConfigError(f"unknown mesh dim(s) {unknown}; dims are pp, dp_replicate, dp_shard, cp, tp")
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    shapes = []
    for pp in divisors if pp_schedules else [1]:
        inner = world_size // pp
        for tp in divisors:
            for cp in divisors:
                for shard in divisors:
                    rest, remainder = divmod(inner, tp * cp * shard)
                    if remainder or rest == 0:
                        continue
                    if pp == 1:
                        shapes.append(MeshShape(rest, shard, cp, tp))
                    else:
                        shapes += [MeshShape(rest, shard, cp, tp, pp, name, **pp_knobs) for name in pp_schedules]
    sizes = lambda s: {**s.as_dict(), "pp": s.pp}  # noqa: E731
    return [s for s in shapes if all(sizes(s)[k] == v for k, v in fixed.items())]


@dataclass(frozen=True)
class Plan:
    """Ranked estimates: ``ranked`` (feasible, fastest first) and ``rejected`` (invalid or out of memory)."""

    model: ModelSpec
    train: TrainingSpec
    cluster: ClusterSpec
    ranked: list[Estimate]
    rejected: list[Estimate]

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def plan(
    model: ModelSpec,
    train: TrainingSpec,
    cluster: ClusterSpec,
    fixed: Mapping[str, int] | None = None,
    search_pp: bool = False,
    pp_schedules: tuple[str, ...] = ("1f1b",),
    **pp_knobs: int,
) -> Plan:
    """Estimate every mesh shape of ``cluster.num_gpus`` and rank the feasible ones by step time. ``search_pp``
    (or a pinned ``pp``): pipeline shapes too, once per schedule in ``pp_schedules``."""
    with_pp = search_pp or dict(fixed or {}).get("pp", 1) > 1
    shapes = mesh_shapes(cluster.num_gpus, fixed, pp_schedules if with_pp else (), **pp_knobs)
    if not shapes:
        pinned = " x ".join(f"{k}={v}" for k, v in dict(fixed or {}).items())
        raise ConfigError(
            f"no mesh shape of {cluster.num_gpus} GPUs matches the pinned sizes {pinned}: "
            f"their product must divide {cluster.num_gpus}"
        )
    estimates = [estimate(model, train, shape, cluster) for shape in shapes]
    ranked = sorted((e for e in estimates if e.feasible), key=lambda e: (e.time.step_s, e.memory.peak))
    # Out-of-memory shapes first (closest to fitting first), then invalid ones.
    rejected = sorted((e for e in estimates if not e.feasible), key=lambda e: (not e.valid, e.memory.peak, e.mesh))
    return Plan(model, train, cluster, ranked, rejected)
