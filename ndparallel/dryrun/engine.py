"""One rank of the real job, in this process: the real mesh, ``parallelize`` and training step on fake tensors.

:func:`measure_rank` is the engine. On a process group that is already rank ``r`` of the job's world (the fake
backend for a dry run, :mod:`ndparallel.dryrun.fake_world`; or a real gloo rank, to check the dry run against a
real one) it builds the job's mesh with :func:`ndparallel.distributed.process.init_distributed`, applies the
job's pre-flight (:meth:`ndparallel.train.job_config.TrainConfig.check_mesh`, the same ``ConfigError`` as the
real job), builds the model (under ``FakeTensorMode`` in a dry run: shapes, no data), parallelises it with the
real :func:`ndparallel.parallelize` (or :func:`ndparallel.parallel.pipeline.build_pipeline` under pp), and runs
the real :class:`ndparallel.train.step.TrainStep` with AdamW (its state made first by one optimizer step on zero
gradients), measuring the step under :class:`~ndparallel.dryrun.tracker.RankTracker` and
:class:`~ndparallel.distributed.counter.CommCounter` (under pp from the first micro-batch, after torch's shape
inference).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ndparallel.config.dims import MESH_DIMS
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.precision import parallelize_config
from ndparallel.config.preflight import check_job as preflight
from ndparallel.distributed.counter import CommCounter
from ndparallel.distributed.local_ops import local_shard
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.process import init_distributed
from ndparallel.dryrun.models import DryRunModel
from ndparallel.dryrun.report import CommRow, RankReport
from ndparallel.dryrun.stage_metadata import StageMailbox, after_shape_inference
from ndparallel.dryrun.torch_api import fake_tensor_mode
from ndparallel.dryrun.tracker import RankTracker
from ndparallel.dryrun.values import DryRunValues, objects_as_if_every_rank_alike
from ndparallel.parallel.parallelize import parallelize
from ndparallel.parallel.pipeline import Pipeline, build_pipeline
from ndparallel.train.job_config import TrainConfig
from ndparallel.train.step import TrainStep

__all__ = ["DIM_ORDER", "check_job", "measure_rank"]

DIM_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp", "ep", "ep_fsdp", "dp_shard_cp", "dp", "dp_cp")
"""The names a collective's group is reported under: the first whose ranks it has (``dp_shard`` before the
``dp_shard_cp`` view of the same ranks when cp is 1)."""


def check_job(cfg: TrainConfig, sizes: ParallelismConfig, model: DryRunModel) -> int:
    """The real job's pre-flight (:meth:`TrainConfig.check_mesh`; another model's shape for one not the job's
    reference Transformer); the micro-batches per step."""
    if model.shape is None:
        return cfg.check_mesh(sizes)
    return preflight(sizes, cfg.job_shape(), model.shape)


def measure_rank(
    cfg: TrainConfig,
    model: DryRunModel,
    *,
    fake: bool = True,
    steps: int = 1,
    mailbox: StageMailbox | None = None,
) -> RankReport:
    """Run ``steps`` training steps of ``cfg`` as this process's rank and measure the last one, with the
    optimizer's state already there (:func:`_create_optimizer_state`): the step of a job under way. Under pp,
    torch's schedule first infers its stages' shapes (a forward and backward of its own, in the first step
    only): the measurement starts after it, at the first micro-batch. ``mailbox``: the pipeline stages' shape
    exchange of a dry run (one per run; pp ranks in order)."""
    start = time.perf_counter()
    mesh = init_distributed(cfg.parallelism, device_type="cpu")
    accumulation = check_job(cfg, mesh.config, model)
    mode = fake_tensor_mode() if fake else None
    wrap = model.wrap
    with mode or contextlib.nullcontext():
        model = model.build()
        local = cfg.train.global_batch // mesh.size("dp")
        tokens = torch.randint(0, _vocab(model), (local, cfg.data.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # Parallelised outside the fake mode: DeviceMesh computes its coordinates with real index tensors.
    model = _parallelise(model, mesh, accumulation)
    if wrap is not None and not isinstance(model, Pipeline):
        model = wrap(model)
    modules = model.stages if isinstance(model, Pipeline) else [model]
    if isinstance(model, Pipeline) and fake:
        (mailbox or StageMailbox()).attach(model.schedule)
    t = cfg.train
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, foreach=True)
        for m in modules
    ]
    values = DryRunValues() if fake else None
    tracker = RankTracker(mode, values)
    step = TrainStep(
        model, optimizers if isinstance(model, Pipeline) else optimizers[0], mesh, max_grad_norm=t.max_grad_norm,
        defer_grad_sync=bool(t.defer_grad_sync), max_nonfinite_steps=t.max_nonfinite_steps, phase=tracker.set_phase,
        router_bias_rate=t.router_bias_rate,
    )  # fmt: skip
    handles = tracker.watch(modules, optimizers)
    counter = CommCounter()
    flops_before = 0

    def measure_from_here() -> None:
        nonlocal flops_before
        tracker.reset_peak()
        counter.calls.clear()
        tracker.ops.clear()
        flops_before = tracker.flops

    if isinstance(model, Pipeline):
        model.absorbs_shape_inference = False  # the step of a job under way: torch's inference inside it
        after_shape_inference(model.schedule, measure_from_here)
    try:
        objects = objects_as_if_every_rank_alike() if fake else contextlib.nullcontext()
        with mode or contextlib.nullcontext(), objects, tracker.active():
            _create_optimizer_state(optimizers)
            tracker.track_all((p for m in modules for p in m.parameters()), "params")
            for number in range(1, steps + 1):
                measured = number == steps
                if measured:
                    measure_from_here()
                with tracker.counting(counter) if measured else contextlib.nullcontext():
                    step(inputs, labels, accumulation, number)
    finally:
        for handle in handles:
            handle.remove()
    return RankReport(
        rank=dist.get_rank(),
        coordinate=_coordinate(mesh),
        stage_ids=list(model.stage_ids) if isinstance(model, Pipeline) else [],
        peak_bytes=tracker.peak.total,
        peak_by_kind=dict(tracker.peak.by_kind),
        state_bytes={**(tracker.state_at_step or {}), "optimizer_step_counters": _step_counter_bytes(optimizers)},
        peak_module=tracker.peak.module,
        peak_phase=tracker.phase_text(tracker.peak.phase),
        activation_peak_bytes=tracker.activation_peak,
        retained_activation_bytes=tracker.retained_activations,
        flops=tracker.flops - flops_before,
        ops=tracker.ops.rows(),
        comms=_comm_rows(counter, mesh),
        accumulation=accumulation,
        local_batch=local,
        stand_in_values=values.stood_in if values else 0,
        uneven_shards=_uneven_shards(modules),
        seconds=time.perf_counter() - start,
    )


def _create_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """AdamW's state, as after a first step: one optimizer step on zero gradients (cheaper than a training step;
    the values do not matter here, the tensors do)."""
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _step_counter_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of AdamW's per-parameter ``step`` counters (a scalar each: counted in the optimizer's state, not in
    the planner's, which counts exp_avg and exp_avg_sq)."""
    return sum(
        local_shard(state["step"]).untyped_storage().nbytes()
        for optimizer in optimizers
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor)
    )


def _parallelise(model: nn.Module, mesh: Mesh, accumulation: int) -> nn.Module | Pipeline:
    """What ``ndparallel train`` does (:func:`ndparallel.train.loop.build_model`), on a model already built."""
    if mesh.config.pp_size > 1:
        return build_pipeline(model, mesh.config, mesh, microbatches=accumulation)
    return parallelize(model, parallelize_config(mesh.config), mesh=mesh)


def _uneven_shards(modules: list[nn.Module]) -> bool:
    """Whether some parameter has a dimension its shards do not divide evenly (the last ranks then hold less)."""
    for module in modules:
        for param in module.parameters():
            if not isinstance(param, DTensor):
                continue
            split: dict[int, int] = {}
            for size, placement in zip(param.device_mesh.shape, param.placements, strict=True):
                if isinstance(placement, Shard):
                    split[placement.dim] = split.get(placement.dim, 1) * size
            if any(param.shape[dim] % parts for dim, parts in split.items()):
                return True
    return False


def _coordinate(mesh: Mesh) -> dict[str, int]:
    """This rank's index along each mesh dim (and ``ep`` under expert parallelism)."""
    dims = [*MESH_DIMS, *(("ep",) if mesh.config.ep_size > 1 else ())]
    return {dim: mesh.coordinate[dim] for dim in dims}


def _vocab(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", None) or getattr(model, "vocab_size", 256))


def _dim_names(mesh: Mesh) -> dict[tuple[int, ...], str]:
    """Global ranks of each mesh dimension's (and view's) group of this rank -> its name."""
    names: dict[tuple[int, ...], str] = {}
    for name in DIM_ORDER:
        try:
            if mesh.size(name) <= 1:
                continue
            group = mesh[name].get_group()
        except (KeyError, ValueError, RuntimeError):  # ep views exist only under ep
            continue
        names.setdefault(tuple(dist.get_process_group_ranks(group)), name)
    return names


def _comm_rows(counter: CommCounter, mesh: Mesh) -> list[CommRow]:
    """The measured step's collectives by mesh dimension and kind."""
    names = _dim_names(mesh)
    rows: dict[tuple[str, str], CommRow] = {}
    for call in counter.calls:
        dim = names.get(call.ranks, "world" if call.group_size == dist.get_world_size() else f"{call.group_size}")
        row = rows.setdefault((dim, call.kind), CommRow(dim, call.kind, call.group_size, 0, 0))
        row.calls += 1
        row.bytes += call.payload_bytes
    return sorted(rows.values(), key=lambda r: (DIM_ORDER.index(r.dim) if r.dim in DIM_ORDER else 99, r.kind))
