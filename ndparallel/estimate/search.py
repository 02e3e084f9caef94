"""Estimate one mesh shape, and search every mesh shape of a world size, ranked by predicted step time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ndparallel.config.preflight import JobShape, job_problems
from ndparallel.errors import ConfigError
from ndparallel.estimate.comm import Collective, collectives
from ndparallel.estimate.memory import MemoryEstimate, estimate_memory
from ndparallel.estimate.pipeline import microbatches
from ndparallel.estimate.spec import ClusterSpec, GiB, MeshShape, ModelSpec, TrainingSpec
from ndparallel.estimate.timing import StepTime, estimate_step_time

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
    """Why ``ndparallel train`` would refuse this shape for this model and batch (empty list = valid): the config's
    own validation, then the job pre-flight the trainer and the bench run (:mod:`ndparallel.config.preflight`),
    with one message for one refusal wherever it is asked."""
    try:
        cfg = mesh.to_config(train).resolve(mesh.world_size)
    except ConfigError as err:
        return [str(err)]
    micro_batch = None if mesh.pp > 1 and mesh.pp_microbatches else train.micro_batch
    job = JobShape(train.global_batch, train.seq_len, micro_batch, train.defer_grad_sync or None)
    return job_problems(cfg, job, model.preflight_shape())


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
