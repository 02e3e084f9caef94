"""Estimate one mesh shape, and search every mesh shape of a world size, ranked by predicted step time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ndparallel.config.dims import divisors
from ndparallel.config.pipeline import check_stages_per_rank, stages_fit_blocks
from ndparallel.config.preflight import JobShape, job_problems
from ndparallel.errors import ConfigError
from ndparallel.estimate.cluster import ClusterSpec
from ndparallel.estimate.comm import Collective, collectives
from ndparallel.estimate.memory import MemoryEstimate, estimate_memory
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.pipeline import microbatches
from ndparallel.estimate.timing import StepTime, estimate_step_time
from ndparallel.estimate.training import TrainingSpec
from ndparallel.estimate.units import GiB
from ndparallel.parallel.compile import check_compile

__all__ = ["MAX_SHAPES", "Estimate", "Plan", "estimate", "mesh_shapes", "plan", "shape_problems"]


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
            "mesh": {**self.mesh.as_dict(), "ep": self.mesh.ep, **(self.mesh.pp_dict() if self.mesh.pp > 1 else {})},
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
    try:
        check_compile(train.compile, mesh.tp)
    except ConfigError as err:
        return [str(err)]
    micro_batch = None if mesh.pp > 1 and mesh.pp_microbatches else train.micro_batch
    job = JobShape(train.global_batch, train.seq_len, micro_batch, train.defer_grad_sync or None)
    return job_problems(cfg, job, model.preflight_shape()) + _moe_tp_problems(model, mesh)


def _moe_tp_problems(model: ModelSpec, mesh: MeshShape) -> list[str]:
    """``parallelize``'s refusal of tp on MoE blocks its family cannot split (``ModelSpec.moe_tp`` False), in its
    own words: :func:`~ndparallel.parallel.moe_tensor_parallel.moe_tp_problem` with no split table (it reads no
    layer then)."""
    if not model.is_moe or model.moe_tp:
        return []
    # Imported here: its module holds the DTensor split too, which the ``ndparallel`` command's parser
    # (this package's ``plan``) does not import up front.
    from ndparallel.parallel.moe_tensor_parallel import moe_tp_problem

    problem = moe_tp_problem((None,), None, mesh.tp, model.family)  # type: ignore[arg-type]  # a stand-in layer
    return [problem] if problem else []


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


MAX_SHAPES = 4096
"""The most mesh shapes one plan estimates (a few seconds of work): a larger search is refused, asking to pin
sizes. 4096 GPUs give 1,610 shapes with pp searched for an 8B model; 2**20 GPUs, 7,566."""


def mesh_shapes(
    world_size: int,
    fixed: Mapping[str, int] | None = None,
    pp_schedules: tuple[str, ...] = (),
    search_ep: bool = False,
    **pp_knobs: int,
) -> list[MeshShape]:
    """Every (dp_replicate, dp_shard, cp, tp) whose product is ``world_size``; ``fixed`` pins dims (``pp`` and
    ``ep`` too). With ``pp_schedules``, also every pp > 1 dividing the world, once per schedule (``pp_knobs``:
    ``pp_microbatches``, ``pp_stages_per_rank``); with ``search_ep`` (a mixture of experts), every ep dividing
    dp_shard x cp, the ranks it borrows."""
    return list(_iter_mesh_shapes(world_size, dict(fixed or {}), pp_schedules, world_size, pp_knobs, search_ep))


def _iter_mesh_shapes(
    world_size: int,
    fixed: dict[str, int],
    pp_schedules: tuple[str, ...],
    max_pp: int,
    pp_knobs: Mapping[str, int],
    search_ep: bool = False,
) -> Iterator[MeshShape]:
    """:func:`mesh_shapes` one at a time, pp at most ``max_pp``: each size runs over the divisors of what the
    sizes before it leave, so the work is the number of shapes, not the world size."""
    bad = {k: v for k, v in fixed.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ConfigError(f"pinned mesh size(s) {bad} must be positive integers")
    unknown = sorted(set(fixed) - {*MeshShape().as_dict(), "pp", "ep"})
    if unknown:
        raise ConfigError(f"unknown mesh dim(s) {unknown}; dims are pp, dp_replicate, dp_shard, cp, tp (and ep)")

    def sizes(dim: str, left: int) -> list[int]:  # the candidates for ``dim`` when ``left`` ranks remain
        return [v for v in ([fixed[dim]] if dim in fixed else divisors(left)) if left % v == 0]

    def eps(borrowed: int) -> list[int]:  # ep borrows from dp_shard x cp; a pinned ep that does not divide them is
        # kept, for the config's own refusal (ndparallel.config.dims.ep_mesh_problem) to name the rule
        if "ep" in fixed:
            return [fixed["ep"]]
        return divisors(borrowed) if search_ep else [1]

    for pp in sizes("pp", world_size) if pp_schedules else [fixed.get("pp", 1)]:
        if pp > max_pp or world_size % pp:
            continue
        for tp in sizes("tp", world_size // pp):
            for cp in sizes("cp", world_size // (pp * tp)):
                for shard in sizes("dp_shard", world_size // (pp * tp * cp)):
                    rest = world_size // (pp * tp * cp * shard)
                    if fixed.get("dp_replicate", rest) != rest:
                        continue
                    for ep in eps(shard * cp):
                        if pp == 1:
                            yield MeshShape(rest, shard, cp, tp, ep=ep)
                        else:
                            yield from (
                                MeshShape(rest, shard, cp, tp, pp, name, **pp_knobs, ep=ep) for name in pp_schedules
                            )


def _searched_shapes(
    model: ModelSpec, world_size: int, fixed: dict[str, int], pp_schedules: tuple[str, ...], **pp_knobs: int
) -> list[MeshShape]:
    """The shapes :func:`plan` estimates: those whose pipeline has no more stages than the model has blocks (the
    config's :func:`~ndparallel.config.pipeline.stages_fit_blocks`: the others are refused by the pre-flight, and
    one costs O(pp**2) to estimate), at most :data:`MAX_SHAPES`."""
    shapes, dropped = [], None
    for shape in _iter_mesh_shapes(world_size, fixed, pp_schedules, model.n_layers, pp_knobs, model.is_moe):
        if not stages_fit_blocks(shape.n_stages, model.n_layers):
            dropped = dropped or shape
            continue
        if len(shapes) == MAX_SHAPES:
            raise ConfigError(
                f"{world_size} GPUs give more than {MAX_SHAPES} mesh shapes to estimate: pin some sizes "
                "(e.g. --tp 8 --cp 1), or pass --no-pp"
            )
        shapes.append(shape)
    too_deep = fixed.get("pp", 1) > model.n_layers and world_size % fixed["pp"] == 0
    if not shapes and (dropped or too_deep):
        shape = dropped or MeshShape(pp=fixed["pp"], pp_schedule=pp_schedules[0] if pp_schedules else "1f1b")
        raise ConfigError(shape_problems(model, TrainingSpec(), shape)[0])
    return shapes


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
    (or a pinned ``pp``): pipeline shapes too, once per schedule in ``pp_schedules``. A mixture of experts is
    searched over ``ep`` too (every divisor of dp_shard x cp; ``fixed`` may pin it)."""
    with_pp = search_pp or dict(fixed or {}).get("pp", 1) > 1
    if with_pp and pp_knobs.get("pp_stages_per_rank"):  # the config's refusal, before any shape is estimated
        for schedule in pp_schedules:
            check_stages_per_rank(schedule, pp_knobs["pp_stages_per_rank"])
    shapes = _searched_shapes(model, cluster.num_gpus, dict(fixed or {}), pp_schedules if with_pp else (), **pp_knobs)
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
