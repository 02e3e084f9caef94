"""Training runs for ``ndparallel verify``: the one-process reference, and the layouts on real gloo ranks.

Every run builds the model from the same seed, trains ``steps`` AdamW steps (clipping at ``max_norm``) on the
same global batches, and returns a :class:`Trace`: the global loss and pre-clip gradient norm of each step,
the full step-1 gradients and the full parameters after the last step (``DTensor.full_tensor()``; under pp
each rank gives its stages' and the parent merges them). Layouts of one world size share ONE spawned group
(:func:`run_layouts`): the ranks train them in turn. A layout the model cannot take (``ConfigError`` on
every rank, e.g. tp not dividing the heads) comes back as its refusal message.
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

__all__ = ["Settings", "Trace", "build_runner", "full_arrays", "make_batches", "reference", "run_layouts"]


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


def run_layouts(spec: ModelSpec, layouts: Sequence[Layout], settings: Settings, progress=print) -> dict[Layout, Trace]:
    """Every layout's trace; one spawned group of gloo ranks per world size."""
    from ndparallel.distributed.spawn import DistributedError, run_distributed

    traces: dict[Layout, Trace] = {}
    for world in sorted({layout.ranks for layout in layouts}):
        group = [layout for layout in layouts if layout.ranks == world]
        progress(f"verify: {world} ranks: {', '.join(layout.name for layout in group)}")
        try:
            per_rank = run_distributed(_train_group, world, spec, group, settings, timeout=settings.timeout)
        except DistributedError as err:
            message = _last_line(err.remote_traceback) or str(err).splitlines()[0]
            traces.update({layout: Trace(error=message) for layout in group})
            continue
        for index, layout in enumerate(group):
            traces[layout] = _merge([rank[index] for rank in per_rank])
    return traces


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _train_group(spec: ModelSpec, layouts: Sequence[Layout], settings: Settings) -> list[Trace]:
    """On every rank: each layout in turn, sharing the process group. A refusal (ConfigError, raised by every
    rank before any collective) moves on to the next layout; any other error may have left a collective half
    done, so the group stops there and the layouts after it are reported as not run."""
    traces = []
    for index, layout in enumerate(layouts):
        try:
            traces.append(_train(spec, layout, settings))
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
    module: nn.Module | None = None  # the parallelised model (None under pp: the stages are the modules)
    mesh: Any = None
    dp_size: int = 1
    dp_rank: int = 0


def _train(spec: ModelSpec, layout: Layout | None, settings: Settings) -> Trace:
    model = spec.build()
    vocab = vocab_size(model)
    runner = build_runner(spec, model, layout, settings)
    torch.manual_seed(settings.runtime_seed)
    if settings.batch % runner.dp_size:
        raise ConfigError(f"--batch {settings.batch} does not divide by the layout's dp size {runner.dp_size}")
    rows = settings.batch // runner.dp_size
    trace = Trace()
    for step, (tokens, labels) in enumerate(make_batches(settings, vocab)):
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


def _adamw(params, settings: Settings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.1)


def build_runner(spec: ModelSpec, model: nn.Module, layout: Layout | None, settings: Settings) -> _Runner:
    from ndparallel.parallel.clip import clip_grad_norm_

    if layout is None:
        step = _plain_step(spec, model, None, settings.accumulation, None)
        clip = lambda norm: clip_grad_norm_(model.parameters(), norm)  # noqa: E731
        optimizers = [_adamw(model.parameters(), settings)]
        return _Runner(step, clip, lambda: list(model.named_parameters()), optimizers, model)
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
    return _Runner(step, clip, lambda: list(model.named_parameters()), optimizers, model, mesh, dp_size, dp_rank)


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
                    logits = spec.logits(model, x, positions)
                loss = cross_entropy_loss(logits, y) / accumulation
                loss.backward()
            total = total + loss.detach()
        return torch.tensor(average_over(mesh["dp_cp"] if mesh else None, total), dtype=torch.float64)

    return step


def _pipeline_runner(model: nn.Module, mesh, settings: Settings, dp_size: int, dp_rank: int) -> _Runner:
    """pp > 1: this rank's stages (the model lends its seeded weights), one AdamW per stage."""
    from ndparallel.parallel.pipeline import build_pipeline

    pipeline = build_pipeline(model, mesh.config, mesh)

    def named() -> list[tuple[str, nn.Parameter]]:
        return [item for stage in pipeline.stages for item in stage.named_parameters()]

    optimizers = [_adamw(stage.parameters(), settings) for stage in pipeline.stages]
    return _Runner(pipeline.step, pipeline.clip_grad_norm_, named, optimizers, None, mesh, dp_size, dp_rank)
