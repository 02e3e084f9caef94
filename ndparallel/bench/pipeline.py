"""Measure pipeline-parallel (pp) training on CPU ranks, to check the pp cost model (docs/planning.md).

Per rank and step: the peak bytes autograd saves for backward during the step (exact storage bytes through
saved-tensor hooks around the whole step, loss included; parameters and rotary tables excluded, the rotary
rows a stage gathers by ``positions`` counted; not RSS, so
other processes' load does not matter), and apart from it the saved bytes still alive from earlier steps
(``retained_bytes``: torch's first-step shape inference keeps part of one micro-batch's graph on every stage
but the last, measured on 2.13), the
local parameter bytes, the payload bytes of every collective and point-to-point send (by mesh dim and
kind), and step times.

The ranks run the project's pipeline runtime, :func:`ndparallel.parallel.pipeline.build_pipeline`
(docs/pipeline-parallel.md),
on a model built on the meta device, with a ``ParallelismConfig`` carrying the run's mesh sizes, pp fields and
mixed precision;
:func:`build_pipeline` below is the one place that builds it.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ndparallel.bench.memory import state_bytes
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.counter import CommCounter
from ndparallel.distributed.local_ops import local_shard
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.process import init_distributed
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.parallel.pipeline import Pipeline
from ndparallel.parallel.pipeline import build_pipeline as build_runtime

__all__ = ["PipelineRun", "SavedActivations", "build_pipeline", "measure_pipeline"]


@dataclass
class PipelineRun:
    """One measured configuration. ``sizes``: mesh sizes by dim (``pp``, ``dp_shard``, ``tp``); ``batch`` is
    the global batch (each dp rank takes its slice); ``microbatches`` the pipeline's m."""

    model: dict[str, Any]
    sizes: dict[str, int]
    schedule: str = "1f1b"
    microbatches: int = 4
    stages_per_rank: int | None = None
    mixed_precision: str = "no"
    """``ParallelismConfig.mixed_precision`` (``no``, ``bf16``, ``fp16``): the runtime's per-stage precision rule."""
    batch: int = 8
    seq: int = 32
    steps: int = 2
    threads: int = 1
    track_memory: bool = True
    """Count saved activations (Python hooks on every saved tensor: off for timing runs)."""

    @property
    def world_size(self) -> int:
        """The ranks the run takes (``ep`` borrows its ranks from dp_shard x cp: it adds none)."""
        return self.parallelism().world_size

    def parallelism(self) -> ParallelismConfig:
        """The run's config: its mesh sizes (``dp_shard`` etc.), pp fields and mixed precision."""
        return ParallelismConfig(
            **{f"{dim}_size": size for dim, size in self.sizes.items()},
            pp_schedule=self.schedule, pp_microbatches=self.microbatches, pp_stages_per_rank=self.stages_per_rank,
            mixed_precision=self.mixed_precision,
        )  # fmt: skip


def build_pipeline(run: PipelineRun) -> Pipeline:
    """This rank's share of ``run``: ``ndparallel.parallel.pipeline.build_pipeline`` on a meta-device model."""
    cfg = run.parallelism()
    mesh = _mesh(tuple(run.sizes.items()))
    with torch.device("meta"):
        model = Transformer(TransformerConfig.from_dict(run.model))
    return build_runtime(model, cfg, mesh)


@functools.cache
def _mesh(sizes: tuple[tuple[str, int], ...]) -> Mesh:
    """The 5-D mesh, built once per process and sizes (new gloo groups are the slow part of a small run)."""
    return init_distributed(ParallelismConfig(**{f"{dim}_size": size for dim, size in sizes}))


class SavedActivations:
    """Live and peak bytes of the storages autograd saves for backward (each storage once; never the ``exclude``d
    tensors, i.e. the stages' buffers, nor the ``modules``' weights), through
    ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self, exclude: list[torch.Tensor], modules: list[nn.Module]):
        self.excluded = {local_shard(t).untyped_storage().data_ptr() for t in exclude}
        self.modules = modules
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def _weight_storages(self) -> set[int]:
        """The storages of the weights registered now (FSDP swaps in its gathered ones around each forward)."""
        return {local_shard(p).untyped_storage().data_ptr() for m in self.modules for p in m.parameters()}

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter):
            return tensor  # a weight (FSDP's gathered copy included), saved as itself or a view (weight.t())
        local = local_shard(tensor)
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # an async collective's result not waited yet: its local elements
            key, size = id(tensor), local.numel() * local.element_size()
        if key in self.excluded or size == 0:
            return tensor
        if key not in self.refs:
            if key in self._weight_storages():
                return tensor  # a weight reached through to_local() (ep's local experts): not a Parameter
            self.live += size
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(self, key, size, tensor)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int, size: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= size


class _Held:
    __slots__ = ("key", "owner", "size", "tensor")

    def __init__(self, owner: SavedActivations, key: int, size: int, tensor: torch.Tensor):
        self.owner, self.key, self.size, self.tensor = owner, key, size, tensor

    def __del__(self) -> None:
        self.owner.release(self.key, self.size)


def _group_labels(mesh: Any, pp_group: Any) -> dict[tuple[int, ...], str]:
    labels = {tuple(dist.get_process_group_ranks(pp_group)): "pp"}
    experts = ("ep", "ep_fsdp") if mesh.size("ep") > 1 else ()  # the views exist under ep only
    for name in ("dp_shard_cp", "tp", "dp_replicate", "dp_cp", *experts):
        if mesh.size(name) > 1:
            labels.setdefault(tuple(dist.get_process_group_ranks(mesh[name].get_group())), name)
    return labels


def _compute_only_s(pipe: Pipeline, run: PipelineRun, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """Seconds this rank's stages take for forward + backward of all micro-batches with no waiting and no
    communication (the no-bubble reference; pure pp only: random stage inputs and output gradients)."""
    from ndparallel.parallel.loss import cross_entropy_loss

    m, n_stages = run.microbatches, len(pipe.stages) * run.sizes["pp"]
    mb_tokens, mb_labels = tokens.tensor_split(m), labels.tensor_split(m)
    dim = run.model["dim"]
    start = time.perf_counter()
    for stage, sid in zip(pipe.stages, pipe.stage_ids, strict=True):
        for i in range(m):
            x = mb_tokens[i] if sid == 0 else torch.randn(*mb_tokens[i].shape, dim, requires_grad=True)
            out = stage(x, torch.arange(x.shape[1]).expand(x.shape[0], -1))
            if sid == n_stages - 1:
                cross_entropy_loss(out, mb_labels[i]).backward()
            else:
                out.backward(torch.ones_like(out))
    elapsed = time.perf_counter() - start
    for stage in pipe.stages:
        stage.zero_grad(set_to_none=True)
    return elapsed


def measure_pipeline(run: PipelineRun) -> dict[str, Any]:
    """Rank entry point: build, train ``run.steps`` steps; measure the last one (memory, communication)."""
    torch.set_num_threads(run.threads)
    pipe = build_pipeline(run)
    mesh = pipe.mesh.without_pp()
    params = [p for stage in pipe.stages for p in stage.parameters()]
    buffers = [b for stage in pipe.stages for b in stage.buffers()]
    tracker = SavedActivations(buffers, list(pipe.stages))
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, run.model["vocab_size"], (run.batch, run.seq + 1), generator=generator)
    local = run.batch // dp
    data = data[dp_rank * local : (dp_rank + 1) * local]
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    times, comm = [], {}
    for step in range(run.steps):
        counter = CommCounter() if step == run.steps - 1 else contextlib.nullcontext()
        retained = tracker.peak = tracker.live
        dist.barrier()
        start = time.perf_counter()
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack)
            if run.track_memory
            else contextlib.nullcontext()
        )
        with counter, hooks:
            pipe.step(tokens, labels)
        dist.barrier()
        times.append(time.perf_counter() - start)
        for stage in pipe.stages:
            stage.zero_grad(set_to_none=True)
    compute = [_compute_only_s(pipe, run, tokens, labels) for _ in range(run.steps)] if not run.track_memory else []
    labels_by_ranks = _group_labels(mesh, pipe.pp_group)
    for call in counter.calls:
        key = f"{labels_by_ranks.get(call.ranks, str(call.ranks))}/{call.kind}"
        comm[key] = comm.get(key, 0) + call.payload_bytes
    return {
        "rank": dist.get_rank(),
        "stage_ids": pipe.stage_ids,
        "saved_activation_bytes": tracker.peak - retained,
        "retained_bytes": retained,
        "param_bytes": state_bytes(params),
        "comm": comm,
        "step_s": times,
        "median_step_s": statistics.median(times[1:] or times),
        "min_step_s": min(times[1:] or times),
        "compute_only_min_s": min(compute[1:] or compute or [float("nan")]),
    }
