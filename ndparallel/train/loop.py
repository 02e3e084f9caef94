"""The training loop behind ``ndparallel train``: one function, every mesh shape.

Per optimizer step each rank runs ``accumulation_steps`` micro-batches of its dp slice (gradient
sync only on the last), clips the global gradient norm, steps AdamW with warmup + cosine decay,
and rank 0 reports the loss averaged over ``dp_cp`` (the true global loss).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ndparallel.mesh import Mesh, init_distributed
from ndparallel.models import Transformer
from ndparallel.train.config import TrainConfig
from ndparallel.train.data import BatchLoader, ByteCorpus
from ndparallel.train.progress import Progress, format_duration, format_rate

__all__ = ["TrainResult", "lr_at", "train"]


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    steps: int = 0


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)


def _device_type(cfg: TrainConfig) -> str:
    requested = os.environ.get("NDP_DEVICE") or cfg.train.device
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip gradient communication inside the block when ``enabled`` is False (accumulation)."""
    if enabled:
        yield
        return
    from ndparallel.grad_sync import no_sync

    with no_sync(model):
        yield


def build_model(cfg: TrainConfig, mesh: Mesh) -> nn.Module:
    from ndparallel.parallelize import parallelize

    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else None
    model = Transformer(cfg.model)
    if device is not None:
        model = model.to(device)
    return parallelize(model, mesh.config, mesh=mesh)


def train(cfg: TrainConfig, mesh: Mesh | None = None) -> TrainResult:
    """Train ``cfg.model`` on ``cfg.data`` for ``cfg.train.steps`` steps; returns losses and throughput."""
    from ndparallel.clip import clip_grad_norm_
    from ndparallel.metrics import average_over, cross_entropy_loss
    from ndparallel.plans.context_parallel import context_parallel

    mesh = mesh or init_distributed(cfg.parallelism, device_type=_device_type(cfg))
    rank0 = dist.get_rank() == 0
    t = cfg.train
    dp_size, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    accumulation = cfg.accumulation_steps(dp_size)
    torch.manual_seed(t.seed)

    model = build_model(cfg, mesh)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, foreach=True
    )
    corpus = ByteCorpus(cfg.data.seq_len, cfg.data.path, cfg.data.max_bytes)
    loader = BatchLoader(corpus, t.global_batch, dp_rank=dp_rank, dp_size=dp_size, seed=t.seed)
    device = next(model.parameters()).device
    tokens_per_step = t.global_batch * cfg.data.seq_len

    if rank0:
        print(
            f"ndparallel train: {cfg.model.num_params() / 1e6:.2f}M params | mesh {mesh.config.describe()} "
            f"({mesh.size()} ranks, {mesh.device_type}) | global batch {t.global_batch} x {cfg.data.seq_len} tokens"
            f" | {accumulation} micro-batch(es) per rank per step | {corpus.num_windows} windows of data",
            flush=True,
        )
    metrics_file = open(t.metrics_file, "a") if (rank0 and t.metrics_file) else None  # noqa: SIM115
    progress = Progress(t.steps, enabled=rank0, every=t.log_every)
    result = TrainResult()
    start = time.perf_counter()
    try:
        for step in range(t.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            inputs, labels = loader.batch(step)
            step_loss = torch.zeros((), device=device)
            for micro, (x, y) in enumerate(zip(inputs.chunk(accumulation), labels.chunk(accumulation), strict=True)):
                x, y = x.to(device), y.to(device)
                positions = torch.arange(x.shape[1], device=device)
                with (
                    _gradient_sync(model, enabled=micro == accumulation - 1),
                    context_parallel(mesh, buffers=[x, y, positions], seq_dims=[1, 1, 0]),
                ):
                    loss = cross_entropy_loss(model(x, positions), y) / accumulation
                    loss.backward()
                step_loss += loss.detach()
            grad_norm = clip_grad_norm_(model.parameters(), t.max_grad_norm if t.max_grad_norm > 0 else math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            global_loss = average_over(mesh["dp_cp"], step_loss)
            result.losses.append(global_loss)
            result.grad_norms.append(float(grad_norm))
            elapsed = time.perf_counter() - start
            rate = tokens_per_step * (step + 1) / elapsed
            fields = {"loss": f"{global_loss:.4f}", "tok/s": format_rate(rate), "lr": f"{lr_at(step, cfg):.1e}"}
            progress.update(step + 1, **fields)
            if metrics_file:
                record = dict(step=step + 1, loss=global_loss, grad_norm=float(grad_norm), lr=lr_at(step, cfg),
                              tokens_per_s=rate, elapsed_s=elapsed)
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
    finally:
        if metrics_file:
            metrics_file.close()
    result.seconds = time.perf_counter() - start
    result.steps = t.steps
    result.tokens_per_s = tokens_per_step * t.steps / result.seconds
    if rank0:
        first, last = result.losses[0], result.losses[-1]
        per_rank = format_rate(result.tokens_per_s / mesh.size())
        print(
            f"done: {t.steps} steps in {format_duration(result.seconds)} | loss {first:.4f} -> {last:.4f} | "
            f"{format_rate(result.tokens_per_s)} tok/s global, {per_rank} per rank",
            flush=True,
        )
    return result

