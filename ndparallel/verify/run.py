"""Training runs for ``ndparallel verify``: the one-process reference, and the layouts on real gloo ranks.

Every run builds the model from the same seed, trains ``steps`` AdamW steps (clipping at ``max_norm``) on the
same global batches, and returns a :class:`Trace`: the global loss and pre-clip gradient norm of each step,
the full step-1 gradients and the full parameters after the last step (``DTensor.full_tensor()``; under pp
each rank gives its stages' and the parent merges them). Layouts of one world size share ONE spawned group
(:func:`run_layouts`): the ranks train them in turn. A layout the model cannot take (``ConfigError`` on
every rank, e.g. tp not dividing the heads) comes back as its refusal message.

``--reshard A>B``: layout A's run (in its group) also saves a DCP checkpoint (model and AdamW state,
:func:`ndparallel.checkpoint.save`) after step ``k = steps // 2``; :func:`run_resumes` loads it on layout B
(one spawned group per B world size) and trains steps ``k+1..steps``. The pair's trace is A's first ``k``
steps then B's: the uninterrupted reference is what it must reproduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.errors import ConfigError
from ndparallel.verify.layouts import Layout
from ndparallel.verify.model import ModelSpec, vocab_size

__all__ = [
    "Settings",
    "Trace",
    "build_runner",
    "full_arrays",
    "make_batches",
    "reference",
    "resume_step",
    "run_layouts",
    "run_resumes",
]


@dataclass(frozen=True)
class Settings:
    steps: int = 3
    batch: int = 4  # global batch, sequences
    seq: int = 16
    lr: float = 1e-3
    max_norm: float = 1.0
    data_seed: int = 1
    runtime_seed: int = 1234  # torch's RNG after the build (dropout and friends draw from it)
    accumulation: int = 1  # the reference's micro-batches (the float64 floor splits the batch in two halves)
    timeout: float = 600.0


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[str, np.ndarray] = field(default_factory=dict)  # step 1, full, by parameter FQN
    params: dict[str, np.ndarray] = field(default_factory=dict)  # after the last step, full
    refused: str | None = None  # the ConfigError the layout was refused with
    error: str | None = None  # anything else a rank raised


def make_batches(settings: Settings, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``(tokens, labels)`` ``[batch, seq]``; labels are the next tokens."""
    generator = torch.Generator().manual_seed(settings.data_seed)
    data = [
        torch.randint(0, vocab, (settings.batch, settings.seq + 1), generator=generator) for _ in range(settings.steps)
    ]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def full_arrays(named: Sequence[tuple[str, torch.Tensor | None]]) -> dict[str, np.ndarray]:
    """Full tensors (DTensors gathered: a collective) as float64 numpy arrays, by name; None entries skipped."""
    out = {}
    for name, tensor in named:
        if tensor is None:
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        out[name] = full.detach().to(torch.float64).cpu().numpy().copy()
    return out


def reference(spec: ModelSpec, settings: Settings) -> Trace:
    """The plain model in this process, no process group: what every layout must reproduce."""
    return _train(spec, None, settings)


def resume_step(settings: Settings) -> int:
    """The step after which ``--reshard`` saves on layout A and resumes on B."""
    return settings.steps // 2


def run_layouts(
    spec: ModelSpec,
    layouts: Sequence[Layout],
    settings: Settings,
    progress=print,
    saves: dict[Layout, str] | None = None,
) -> dict[Layout, Trace]:
    """Every layout's trace; one spawned group of gloo ranks per world size. A layout in ``saves`` also writes
    a checkpoint there after :func:`resume_step`."""
    groups = [[layout for layout in layouts if layout.ranks == world] for world in sorted({x.ranks for x in layouts})]
    jobs = [[(layout, None, (saves or {}).get(layout)) for layout in group] for group in groups]
    return _run_groups(spec, jobs, settings, progress, "")


def run_resumes(
    spec: ModelSpec, pairs: Sequence[tuple[Layout, Layout, str]], settings: Settings, progress=print
) -> dict[tuple[Layout, Layout], Trace]:
    """Layout B's steps after :func:`resume_step`, from the checkpoint layout A saved, for each ``(A, B,
    path)``; one spawned group per world size of B."""
    worlds = sorted({b.ranks for _, b, _ in pairs})
    jobs = [[(b, path, None) for _, b, path in pairs if b.ranks == world] for world in worlds]
    traces = _run_groups(spec, jobs, settings, progress, " (resumed from a checkpoint)")
    ordered = [pair for world in worlds for pair in pairs if pair[1].ranks == world]
    return {(a, b): traces[index] for index, (a, b, _) in enumerate(ordered)}


def _run_groups(spec: ModelSpec, jobs, settings: Settings, progress, what: str) -> dict:
    """Each group of ``(layout, load_from, save_to)`` jobs on one spawned group of ranks; traces by layout
    (:func:`run_layouts`) or by position (:func:`run_resumes`)."""
    from ndparallel.distributed.spawn import DistributedError, run_distributed

    traces: dict = {}
    position = 0
    for group in jobs:
        world = group[0][0].ranks
        progress(f"verify: {world} ranks{what}: {', '.join(layout.name for layout, _, _ in group)}")
        try:
            per_rank = run_distributed(_train_group, world, spec, group, settings, timeout=settings.timeout)
            merged = [_merge([rank[index] for rank in per_rank]) for index in range(len(group))]
        except DistributedError as err:
            message = _last_line(err.remote_traceback) or str(err).splitlines()[0]
            merged = [Trace(error=message) for _ in group]
        for (layout, load_from, _), trace in zip(group, merged, strict=True):
            traces[position if load_from else layout] = trace
            position += 1
    return traces


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _train_group(spec: ModelSpec, jobs: Sequence[tuple[Layout, str | None, str | None]], settings: Settings):
    """On every rank: each ``(layout, load_from, save_to)`` in turn, sharing the process group. A refusal
    (ConfigError, raised by every rank before any collective) moves on to the next layout; any other error may
    have left a collective half done, so the group stops there and the layouts after it are reported as not
    run."""
    traces = []
    layouts = [layout for layout, _, _ in jobs]
    for index, (layout, load_from, save_to) in enumerate(jobs):
        try:
            traces.append(_train(spec, layout, settings, load_from, save_to))
        except ConfigError as err:
            traces.append(Trace(refused=str(err)))
        except Exception as err:
            traces.append(Trace(error=f"{type(err).__name__}: {err}".splitlines()[0]))
            skipped = f"not run: {layout.name} failed before it in the same group of ranks"
            return traces + [Trace(error=skipped) for _ in layouts[index + 1 :]]
    return traces


def _merge(traces: Sequence[Trace]) -> Trace:
    """One layout's trace from its ranks': rank 0's losses and norms (global on every rank), the union of the
    ranks' full tensors (pp ranks hold different stages)."""
    first = traces[0]
    if first.refused or first.error:
        return first
    merged = replace(first, grads={}, params={})
    for trace in traces:
        merged.grads.update(trace.grads)
        merged.params.update(trace.params)
    return merged


@dataclass
class _Runner:
    """A model on a mesh (or none): how to run one step of forward/backward, clip, and list its parameters."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # this rank's slice -> global loss
    clip: Callable[[float], torch.Tensor]
    named_parameters: Callable[[], list[tuple[str, nn.Parameter]]]
    optimizers: list[torch.optim.Optimizer]
    modules: list[nn.Module]  # what a checkpoint holds: the model, or this rank's pipeline stages
    module: nn.Module | None = None  # the parallelised model (None under pp: the stages are the modules)
    mesh: Any = None
    dp_size: int = 1
    dp_rank: int = 0


def _train(
    spec: ModelSpec, layout: Layout | None, settings: Settings, load_from: str | None = None, save_to: str | None = None
) -> Trace:
    """Train ``settings.steps`` steps; with ``load_from``, resume from that checkpoint after
    :func:`resume_step` (the trace then holds the steps after it); with ``save_to``, save there after it."""
    from ndparallel import checkpoint

    model = spec.build()
    vocab = vocab_size(model)
    runner = build_runner(spec, model, layout, settings)
    if settings.batch % runner.dp_size:
        raise ConfigError(f"--batch {settings.batch} does not divide by the layout's dp size {runner.dp_size}")
    k = resume_step(settings)
    if load_from:
        checkpoint.load(load_from, *_checkpointed(runner), restore_rng=False)
    torch.manual_seed(settings.runtime_seed)
    rows = settings.batch // runner.dp_size
    trace = Trace()
    for step, (tokens, labels) in enumerate(make_batches(settings, vocab)):
        if load_from and step < k:
            continue
        if save_to and step == k:
            checkpoint.save(save_to, *_checkpointed(runner), save_rng=False, step=k)
        part = slice(runner.dp_rank * rows, (runner.dp_rank + 1) * rows)
        trace.losses.append(float(runner.step(tokens[part], labels[part])))
        if step == 0:
            trace.grads = full_arrays([(n, p.grad) for n, p in runner.named_parameters()])
        trace.grad_norms.append(float(runner.clip(settings.max_norm)))
        for optimizer in runner.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    trace.params = full_arrays(runner.named_parameters())
    return trace


def _checkpointed(runner: _Runner) -> tuple[Any, Any]:
    """The model (or the list of this rank's pipeline stages) and its optimizer(s), as checkpoint.save takes them."""
    if runner.module is not None:
        return runner.modules[0], runner.optimizers[0]
    return runner.modules, runner.optimizers


def _adamw(params, settings: Settings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.1)


def build_runner(spec: ModelSpec, model: nn.Module, layout: Layout | None, settings: Settings) -> _Runner:
    from ndparallel.parallel.clip import clip_grad_norm_

    if layout is None:
        step = _plain_step(spec, model, None, settings.accumulation, None)
        clip = lambda norm: clip_grad_norm_(model.parameters(), norm)  # noqa: E731
        optimizers = [_adamw(model.parameters(), settings)]
        return _Runner(step, clip, lambda: list(model.named_parameters()), optimizers, [model], model)
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.config.precision import forward_autocast_dtype, parallelize_config
    from ndparallel.distributed.process import init_distributed

    extra = {"mixed_precision": "bf16"} if spec.dtype == "bf16" else {}
    cfg = ParallelismConfig.from_dict(layout.parallelism(**extra))
    mesh = init_distributed(cfg, device_type="cpu")  # a CPU proof, also on a machine with GPUs
    dp_size, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    if layout.size("pp") > 1:
        if spec.tp_plan_ref and layout.size("tp") > 1:
            raise ConfigError(
                f"{layout.name}: --tp-plan is not applied to pipeline stages (they take the family's plan); verify "
                "pp and tp in separate layouts"
            )
        return _pipeline_runner(model, mesh, settings, dp_size, dp_rank)
    from ndparallel.parallel.parallelize import parallelize

    model = parallelize(model, parallelize_config(mesh.config), mesh, tp_plan=spec.tp_plan(model))
    step = _plain_step(spec, model, mesh, 1, forward_autocast_dtype(mesh.config))
    clip = lambda norm: clip_grad_norm_(model.parameters(), norm)  # noqa: E731
    optimizers = [_adamw(model.parameters(), settings)]
    return _Runner(
        step, clip, lambda: list(model.named_parameters()), optimizers, [model], model, mesh, dp_size, dp_rank
    )


def _plain_step(spec: ModelSpec, model: nn.Module, mesh, accumulation: int, autocast: torch.dtype | None):
    """Forward/backward of a rank's ``[rows, seq]`` slice in ``accumulation`` micro-batches (cp shards the
    sequence); returns the global-batch loss (averaged over ``dp_cp``)."""
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.context_parallel import context_parallel
    from ndparallel.parallel.loss import cross_entropy_loss

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for x, y in zip(tokens.chunk(accumulation), labels.chunk(accumulation), strict=True):
            x, y = x.clone(), y.clone()
            positions = torch.arange(x.shape[1])
            buffers = [x, y, positions]
            sharding = context_parallel(mesh, buffers, seq_dims=[1, 1, 0], no_restore=buffers) if mesh else None
            with sharding or contextlib.nullcontext():
                with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                    logits, aux = spec.forward(model, x, positions)
                loss = cross_entropy_loss(logits, y)  # + an MoE's router losses, as training adds them
                loss = (loss if aux is None else loss + aux) / accumulation
                loss.backward()
            total = total + loss.detach()
        return torch.tensor(average_over(mesh["dp_cp"] if mesh else None, total), dtype=torch.float64)

    return step


def _pipeline_runner(model: nn.Module, mesh, settings: Settings, dp_size: int, dp_rank: int) -> _Runner:
    """pp > 1: this rank's stages (the model lends its seeded weights), one AdamW per stage."""
    from ndparallel.parallel.pipeline import build_pipeline
    from ndparallel.parallel.pipeline.tied import one_process_parameters

    pipeline = build_pipeline(model, mesh.config, mesh)

    def named() -> list[tuple[str, nn.Parameter]]:  # a tied weight's copy under the weight's name
        return [item for stage in pipeline.stages for item in one_process_parameters(stage)]

    optimizers = [_adamw(stage.parameters(), settings) for stage in pipeline.stages]
    stages = list(pipeline.stages)
    return _Runner(pipeline.step, pipeline.clip_grad_norm_, named, optimizers, stages, None, mesh, dp_size, dp_rank)
