"""Measure pipeline-parallel (pp) training on CPU ranks, to check the pp cost model (docs/planning.md).

Per rank and step: the peak bytes autograd saves for backward during the step (exact storage bytes through
saved-tensor hooks around the whole step, loss included; parameters and rotary tables excluded; not RSS, so
other processes' load does not matter), and apart from it the saved bytes still alive from earlier steps
(``retained_bytes``: torch's first-step shape inference keeps part of one micro-batch's graph on every stage
but the last, measured on 2.13), the
local parameter bytes, the payload bytes of every collective and point-to-point send (by mesh dim and
kind), and step times.

**Stand-in until ``ndparallel.pipeline`` lands.** pp-core (issue 13) is writing the project's pipeline
runtime (``ndparallel.pipeline.build_pipeline(model, cfg, mesh)``, PP_CONTRACT.md). Until it merges,
:func:`build_pipeline` below builds the same thing the measured spike did: torch's ``PipelineStage`` and
schedules, one stage module per stage keeping the unsplit model's FQNs, each parallelised by
``ndparallel.parallelize`` on the mesh without pp (FSDP with ``reshard_after_forward=False``). It is the
ONE function to swap for the contract's ``build_pipeline``: its result has the contract's ``stages``,
``stage_ids`` and ``step(tokens, labels)``. Limits of the stand-in: no context parallel, no pure
``dp_replicate`` (both need the runtime's handling), fp32 only.
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

# The documented extension point for intercepting aten ops lives in a private module on torch 2.11-2.14.
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.errors import ConfigError

__all__ = ["PipelineRun", "SavedActivations", "StepCounter", "build_pipeline", "measure_pipeline", "stage_block_ranges"]

# Our schedule names -> (torch class, several stages per rank)
TORCH_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "looped_bfs": ("ScheduleLoopedBFS", True),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", True),
    "zbv": ("ScheduleZBVZeroBubble", True),
    "dualpipev": ("ScheduleDualPipeV", True),
}
V_SCHEDULES = ("zbv", "dualpipev")


@dataclass
class PipelineRun:
    """One measured configuration. ``sizes``: mesh sizes by dim (``pp``, ``dp_shard``, ``tp``); ``batch`` is
    the global batch (each dp rank takes its slice); ``microbatches`` the pipeline's m."""

    model: dict[str, Any]
    sizes: dict[str, int]
    schedule: str = "1f1b"
    microbatches: int = 4
    stages_per_rank: int | None = None
    batch: int = 8
    seq: int = 32
    steps: int = 2
    threads: int = 1
    track_memory: bool = True
    """Count saved activations (Python hooks on every saved tensor: off for timing runs)."""

    @property
    def world_size(self) -> int:
        size = 1
        for value in self.sizes.values():
            size *= value
        return size

    @property
    def per_rank(self) -> int:
        return self.stages_per_rank or (2 if TORCH_SCHEDULES[self.schedule][1] else 1)


def stage_block_ranges(n_blocks: int, n_stages: int) -> list[range]:
    """Contiguous block ranges, as even as possible (the first stages get the remainder)."""
    base, extra = divmod(n_blocks, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        count = base + (1 if s < extra else 0)
        out.append(range(start, start + count))
        start += count
    return out


class _Stage(nn.Module):
    """The blocks of one stage under the unsplit model's FQNs (``layers.<i>``); ``tok_embeddings`` on the first
    stage, ``norm`` and ``output`` on the last. The rotary tables are sliced (views, not copies)."""

    def __init__(self, full: nn.Module, blocks: range, first: bool, last: bool, seq: int):
        super().__init__()
        self.config, self.first, self.last, self.seq = full.config, first, last, seq
        if first:
            self.tok_embeddings = full.tok_embeddings
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in blocks})
        if last:
            self.norm, self.output = full.norm, full.output
        self.register_buffer("rope_cos", full.rope_cos, persistent=False)
        self.register_buffer("rope_sin", full.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_cos[: self.seq], self.rope_sin[: self.seq]
        if self.first:
            h = self.tok_embeddings(h)
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.output(self.norm(h)) if self.last else h


class _LocalPipeline:
    """The contract's ``Pipeline`` surface: ``stages``, ``stage_ids``, ``step(tokens, labels)``."""

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], schedule: Any, pp_group: Any):
        self.stages, self.stage_ids, self.schedule, self.pp_group = stages, stage_ids, schedule, pp_group

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        self.schedule.step(*((tokens,) if 0 in self.stage_ids else ()), target=labels, losses=losses)
        local = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())
        return local


def build_pipeline(run: PipelineRun) -> tuple[_LocalPipeline, Any]:
    """This rank's stages and schedule for ``run`` (the stand-in for ``ndparallel.pipeline.build_pipeline``).

    Returns the pipeline and the ``ndparallel.Mesh`` without pp its stages were parallelised on."""
    import torch.distributed.pipelining as pipelining

    from ndparallel.metrics import cross_entropy_loss
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.models.family import transformer_tp_plan
    from ndparallel.parallelize import parallelize

    sizes = {d: run.sizes.get(d, 1) for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    if sizes["cp"] > 1 or (sizes["dp_replicate"] > 1 and sizes["dp_shard"] == 1):
        raise ConfigError("the stand-in pipeline harness measures pp with dp_shard and tp only (no cp, no replicate)")
    root, mesh = _meshes(tuple(sizes.items()))

    pp, per_rank = sizes["pp"], run.per_rank
    n_stages = pp * per_rank
    pp_rank = root["pp"].get_local_rank()
    if run.schedule in V_SCHEDULES:
        ids = [pp_rank, 2 * pp - 1 - pp_rank]
    else:
        ids = [pp_rank + i * pp for i in range(per_rank)]
    mcfg = TransformerConfig.from_dict(run.model)
    ranges = stage_block_ranges(mcfg.n_layers, n_stages)
    plan = transformer_tp_plan()
    modules, stages = [], []
    for sid in ids:
        with torch.device("meta"):
            full = Transformer(mcfg)
        stage = _Stage(full, ranges[sid], sid == 0, sid == n_stages - 1, run.seq)
        names = set(dict(stage.named_children()))
        stage_plan = {k: v for k, v in plan.items() if k.split(".")[0] in names}
        parallelize(stage, mesh.config, mesh=mesh, plan=stage_plan, blocks=[f"layers.{k}" for k in stage.layers])
        stage.to_empty(device="cpu")
        _init_stage(stage, mcfg, sid)
        modules.append(stage)
        stages.append(pipelining.PipelineStage(stage, sid, n_stages, torch.device("cpu"), group=root["pp"].get_group()))
    cls_name, multi = TORCH_SCHEDULES[run.schedule]
    schedule = getattr(pipelining, cls_name)(
        stages if multi else stages[0], run.microbatches, loss_fn=cross_entropy_loss
    )
    return _LocalPipeline(modules, ids, schedule, root["pp"].get_group()), mesh


@functools.cache
def _meshes(sizes: tuple[tuple[str, int], ...]) -> tuple[Any, Any]:
    """The 5-D root mesh and the ``ndparallel.Mesh`` without pp (built once per process and sizes: new gloo
    groups are the slow part of a small run)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ndparallel.config import ParallelismConfig
    from ndparallel.mesh import VIEWS, Mesh, _flatten

    dims = dict(sizes)
    root = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    inner = root["dp_replicate", "dp_shard", "cp", "tp"]
    cfg = ParallelismConfig(
        dp_replicate_size=dims["dp_replicate"], dp_shard_size=dims["dp_shard"], tp_size=dims["tp"],
        reshard_after_forward=False,  # under pp FSDP keeps units gathered (docs/planning.md, "FSDP x pp")
    ).resolve(inner.size())  # fmt: skip
    return root, Mesh(inner, cfg, {name: _flatten(inner[d], name) for name, d in VIEWS.items()})


@torch.no_grad()
def _init_stage(stage: _Stage, mcfg: Any, seed: int) -> None:
    from ndparallel.models.transformer import rotary_tables

    cos, sin = rotary_tables(mcfg.head_dim, mcfg.max_seq_len, mcfg.rope_theta, dtype=mcfg.torch_dtype)
    stage.rope_cos, stage.rope_sin = cos, sin
    generator = torch.Generator().manual_seed(seed)
    for name, param in stage.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        local.fill_(1.0) if name.endswith("norm.weight") else local.normal_(0.0, 0.02, generator=generator)


class SavedActivations:
    """Live and peak bytes of the storages autograd saves for backward (each storage once; ``exclude``d
    tensors, i.e. parameters and rotary tables, never), through ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self, exclude: list[torch.Tensor]):
        self.excluded = {_local(t).untyped_storage().data_ptr() for t in exclude}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter):
            return tensor  # a weight (FSDP's gathered copy included), saved as itself or a view (weight.t())
        local = _local(tensor)
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # an async collective's result not waited yet: its local elements
            key, size = id(tensor), local.numel() * local.element_size()
        if key in self.excluded or size == 0:
            return tensor
        if key not in self.refs:
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _group_labels(mesh: Any, pp_group: Any) -> dict[tuple[int, ...], str]:
    labels = {tuple(dist.get_process_group_ranks(pp_group)): "pp"}
    for name in ("dp_shard_cp", "tp", "dp_replicate"):
        if mesh.size(name) > 1:
            labels.setdefault(tuple(dist.get_process_group_ranks(mesh[name].get_group())), name)
    return labels


class StepCounter(TorchDispatchMode):
    """``CommCounter``'s recording without ``CommDebugMode``'s module tracker, which fails (IndexError, torch 2.13)
    when one counted region runs several forward and backward passes, as a pipeline schedule's step does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        from ndparallel.comm.counter import CommCounter

        CommCounter._record(self, func, args)  # the one mapping of ops to kinds and payloads
        return func(*args, **(kwargs or {}))


def _compute_only_s(pipe: _LocalPipeline, run: PipelineRun, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """Seconds this rank's stages take for forward + backward of all micro-batches with no waiting and no
    communication (the no-bubble reference; pure pp only: random stage inputs and output gradients)."""
    from ndparallel.metrics import cross_entropy_loss

    m, n_stages = run.microbatches, len(pipe.stages) * run.sizes["pp"]
    mb_tokens, mb_labels = tokens.tensor_split(m), labels.tensor_split(m)
    dim = run.model["dim"]
    start = time.perf_counter()
    for stage, sid in zip(pipe.stages, pipe.stage_ids, strict=True):
        for i in range(m):
            x = mb_tokens[i] if sid == 0 else torch.randn(*mb_tokens[i].shape, dim, requires_grad=True)
            out = stage(x)
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
    from ndparallel.bench.memory import state_bytes

    torch.set_num_threads(run.threads)
    pipe, mesh = build_pipeline(run)
    params = [p for stage in pipe.stages for p in stage.parameters()]
    buffers = [b for stage in pipe.stages for b in stage.buffers()]
    tracker = SavedActivations(params + buffers)
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, run.model["vocab_size"], (run.batch, run.seq + 1), generator=generator)
    local = run.batch // dp
    data = data[dp_rank * local : (dp_rank + 1) * local]
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    times, comm = [], {}
    for step in range(run.steps):
        counter = StepCounter() if step == run.steps - 1 else contextlib.nullcontext()
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
