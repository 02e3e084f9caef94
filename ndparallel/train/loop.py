"""The training loop behind ``ndparallel train``: one function, every mesh shape.

Per optimizer step each rank sets the learning rate (warmup + cosine decay), runs
:class:`ndparallel.train.step.TrainStep` on its dp slice of the global batch (micro-batches,
clipping, the non-finite guard, AdamW), and rank 0 reports the loss averaged over ``dp_cp`` (the
true global loss); checkpoints, resume, signals and the watchdog are handled here.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ndparallel import checkpoint
from ndparallel.config.precision import parallelize_config
from ndparallel.distributed.agree import agree, failed_ranks
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.peak import device_peak
from ndparallel.distributed.process import init_distributed
from ndparallel.distributed.reduce import average_over
from ndparallel.distributed.watchdog import Watchdog
from ndparallel.errors import ConfigError, JobError
from ndparallel.models import Transformer
from ndparallel.parallel.parallelize import parallelize
from ndparallel.parallel.pipeline import Pipeline, build_pipeline
from ndparallel.train.checkpoint_folder import hold_checkpoint_dir
from ndparallel.train.data import BatchLoader, ByteCorpus
from ndparallel.train.job_config import TrainConfig, job_device
from ndparallel.train.progress import Progress, format_duration, format_rate, format_router_health, router_health
from ndparallel.train.step import TrainStep

__all__ = ["TrainResult", "job_peak_flops", "lr_at", "train"]


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    start_step: int = 0
    """Step the run resumed from (0 for a fresh run)."""
    interrupted: bool = False
    """Stopped early by SIGINT/SIGTERM (after saving, when checkpointing is on)."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)


def build_model(cfg: TrainConfig, mesh: Mesh, microbatches: int = 1) -> nn.Module | Pipeline:
    """The reference Transformer on this rank's device, parallelised over ``mesh`` (mixed precision as
    :func:`ndparallel.config.precision.parallelize_config` says: FSDP's policy, or the step's autocast). With
    ``pp_size > 1``: this rank's pipeline stages, built from the model on the meta device, running
    ``microbatches`` micro-batches per step."""
    if mesh.config.pp_size > 1:
        with torch.device("meta"):
            model = Transformer(cfg.model)
        return build_pipeline(model, mesh.config, mesh, microbatches=microbatches)
    model = Transformer(cfg.model).to(mesh.device)
    return parallelize(model, parallelize_config(mesh.config), mesh=mesh)


def _optimizers(cfg: TrainConfig, model: nn.Module | Pipeline) -> list[torch.optim.Optimizer]:
    """AdamW over ``model``: one per stage module under pp (the checkpoint's layout), else one."""
    t = cfg.train
    modules = model.stages if isinstance(model, Pipeline) else [model]
    return [
        torch.optim.AdamW(m.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, foreach=True)
        for m in modules
    ]


def job_peak_flops(cfg: TrainConfig, mesh: Mesh) -> float | None:
    """Peak FLOP/s of the whole job, the MFU denominator (rank 0 only; None elsewhere or when unknown).

    ``train.peak_tflops`` per device if set; else the bf16 data-sheet peak of a known GPU times the
    GPU count, or, on CPU, the measured matmul peak of this machine times the node count (simulated
    ranks share one machine's cores).
    """
    if dist.get_rank() != 0:
        return None
    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops * 1e12 * mesh.size()
    peak = device_peak(mesh.device_type, cfg.parallelism.mixed_precision).flops
    if math.isnan(peak):
        return None
    if mesh.device_type == "cuda":
        return peak * mesh.size()
    return peak * max(1, mesh.size() // int(os.environ.get("LOCAL_WORLD_SIZE", mesh.size())))


_REPEAT_WINDOW_S = 2.0
"""A second SIGINT/SIGTERM this soon after the first is the same request: the launcher forwards the signal
that scancel, a preemption or ``kill`` of the process group also sent each rank directly."""


_FORWARD_WAIT_S = 30.0
"""After train() returns, how long a signal still counts as the launcher's forward of the stop (then it is the
user's again, delivered to the previous handler)."""


class _StopRequest:
    """SIGINT/SIGTERM set a flag; all ranks agree on it at the end of each step, so they stop together.

    A rank usually gets one stop twice (its own signal, and the launcher's forward, a few ms later or, on a
    loaded machine, seconds later): under a launcher (torchrun's ``TORCHELASTIC_RUN_ID``) the first repeat is
    that forward whenever it comes; alone, a repeat within ``_REPEAT_WINDOW_S`` is. Any later signal (a
    deliberate second Ctrl-C) stops at once.
    """

    def __init__(self) -> None:
        self.local = False
        self._first: float | None = None
        self._forward_pending = "TORCHELASTIC_RUN_ID" in os.environ  # one repeat is the launcher's forward
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self.local = True
        elif self._forward_pending:  # the same request, forwarded by the launcher
            self._forward_pending = False
        elif now - self._first > _REPEAT_WINDOW_S:  # asked again, later: stop now
            raise KeyboardInterrupt

    def agreed(self) -> int | None:
        """Collective: the lowest rank that received a stop signal (the same answer on every rank), or None."""
        signalled = failed_ranks(self.local)
        return signalled[0] if signalled else None

    def restore(self) -> None:
        """The handlers from before ``train()``. After a stop whose launcher forward has not come yet (it can come
        this late on a loaded machine), that one signal is swallowed first: under the previous handler it would
        raise KeyboardInterrupt inside the interpreter's shutdown."""
        if self._first is not None and self._forward_pending:
            for sig in self._previous:
                signal.signal(sig, self._swallow_forward)
            return
        self._restore_previous()

    def _swallow_forward(self, signum, frame) -> None:
        self._restore_previous()
        if time.monotonic() - self._first > _FORWARD_WAIT_S:  # not the forward: a deliberate signal, long after
            signal.raise_signal(signum)

    def _restore_previous(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _open_metrics_file(path: str | None, rank0: bool):
    """Rank 0 opens the JSONL file; every rank learns whether that worked, so a bad path fails
    the whole job at once instead of leaving the other ranks waiting in the first collective."""
    if not path:
        return None
    handle, error = None, None
    if rank0:
        try:
            handle = open(path, "a")  # noqa: SIM115  (closed at the end of train())
        except OSError as err:
            error = str(err)  # text: raised as a ConfigError on every rank, one process included
    agree(error, f"train.metrics_file={path!r} cannot be written", error_type=ConfigError)
    return handle


def _resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint to start from: an explicit path, the newest under ``checkpoint.dir`` when
    ``resume`` is true or torchrun restarted the job (``--max-restarts``), else None."""
    c = cfg.checkpoint
    if isinstance(c.resume, str):
        return c.resume
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if c.dir and (c.resume or restarted):
        found = checkpoint.resolve_latest(c.dir)
        if found is None and c.resume and dist.get_rank() == 0:
            print(f"ndparallel train: nothing to resume in checkpoint.dir={c.dir!r}: starting at step 0", flush=True)
        return found
    return None


def _save(cfg: TrainConfig, step: int, model, optimizer, loader: BatchLoader, rank0: bool) -> None:
    path = Path(cfg.checkpoint.dir) / f"step-{step:08d}"
    checkpoint.save(path, model, optimizer, keep_last=cfg.checkpoint.keep_last, step=step, data=loader.state_dict())
    if rank0:
        print(f"saved checkpoint {path}", flush=True)


def train(cfg: TrainConfig, mesh: Mesh | None = None) -> TrainResult:
    """Train ``cfg.model`` on ``cfg.data`` for ``cfg.train.steps`` steps; returns losses and throughput.

    A rank that waits ``train.timeout_s`` for its peers ends the job naming the rank(s) behind, and a
    collective that fails because a peer died names that peer (see ``ndparallel.distributed.watchdog``).
    """
    mesh = mesh or init_distributed(cfg.parallelism, device_type=job_device(cfg), timeout_s=cfg.train.timeout_s)
    watchdog = Watchdog.for_job(cfg.train.timeout_s)
    try:
        with hold_checkpoint_dir(cfg.checkpoint):  # rank 0 locks checkpoint.dir for the whole job
            return _train(cfg, mesh, watchdog)
    except RuntimeError as err:
        lost = watchdog.explain(err)
        if lost is None:
            raise
        raise lost from err
    except MemoryError as err:  # its message is often empty: name the rank and what it was doing
        raise JobError(
            f"rank {dist.get_rank()} ran out of host memory while {watchdog.current_phase()} "
            f"({type(err).__name__}{': ' + str(err) if str(err) else ''}); lower what that phase holds "
            "(data.max_bytes, the model, the batch) or use more machines"
        ) from None
    finally:
        watchdog.stop()


def _train(cfg: TrainConfig, mesh: Mesh, watchdog: Watchdog) -> TrainResult:
    rank0 = dist.get_rank() == 0
    t = cfg.train
    accumulation = cfg.check_mesh(mesh.config)
    torch.manual_seed(t.seed)

    watchdog.phase("building the model")
    model = build_model(cfg, mesh, accumulation)
    optimizers = _optimizers(cfg, model)
    # What checkpoints hold: the model and its optimizer, or (pp) the lists of stage modules and optimizers.
    saved_model = model.stages if isinstance(model, Pipeline) else model
    optimizer = optimizers if isinstance(model, Pipeline) else optimizers[0]
    watchdog.phase(f"reading data.path={cfg.data.path!r}" if cfg.data.path else "building the embedded corpus")
    d = cfg.data
    corpus = ByteCorpus(d.seq_len, d.path, d.max_bytes, documents=d.documents, text_field=d.text_field)
    loader = BatchLoader(corpus, t.global_batch, dp_rank=mesh.local_rank("dp"), dp_size=mesh.size("dp"), seed=t.seed)
    train_step = TrainStep(
        model, optimizer, mesh, max_grad_norm=t.max_grad_norm, defer_grad_sync=bool(t.defer_grad_sync),
        max_nonfinite_steps=t.max_nonfinite_steps, verbose=rank0, phase=watchdog.phase,
        router_bias_rate=t.router_bias_rate,
    )  # fmt: skip

    result = TrainResult()
    resume = _resume_path(cfg)
    if resume:
        watchdog.phase(f"loading checkpoint {resume}")
        state = checkpoint.load(resume, saved_model, optimizer, verify=cfg.checkpoint.verify)
        loader.load_state_dict(state["data"])
        result.start_step = int(state["step"])
    if rank0:
        print(
            f"ndparallel train: {cfg.model.num_params() / 1e6:.2f}M params | mesh {mesh.config.describe()} "
            f"({mesh.size()} ranks, {mesh.device_type}) | global batch {t.global_batch} x {cfg.data.seq_len} tokens"
            f" | {accumulation} micro-batch(es) per rank per step | {corpus.num_windows} windows of data"
            + (f" ({len(corpus.starts)} documents, masked apart)" if corpus.documents else "")
            + (f" | resumed from {resume} at step {result.start_step}" if resume else ""),
            flush=True,
        )
    watchdog.phase("opening train.metrics_file")
    log = _StepLog(cfg, mesh, rank0, result)
    stop = _StopRequest()
    step = result.start_step
    try:
        while step < t.steps:
            lr = lr_at(step, cfg)
            for group in (g for o in optimizers for g in o.param_groups):
                group["lr"] = lr
            done = train_step(*loader.batch(step), accumulation, step + 1, **loader.masks(step))
            step += 1
            loader.step = step
            watchdog.phase(f"step {step}: loss average and stop agreement")
            log.record(
                step, average_over(mesh["dp_cp"], done.loss), done.grad_norm, lr, router_health(done.router_loads)
            )
            signalled = stop.agreed()
            every = cfg.checkpoint.every
            if cfg.checkpoint.dir and done.applied and (step == t.steps or signalled is not None or
                                                        (every and step % every == 0)):  # fmt: skip
                watchdog.phase(f"step {step}: checkpoint save")
                _save(cfg, step, saved_model, optimizer, loader, rank0)
            if signalled is not None:
                result.interrupted = True
                if rank0:
                    print(f"stopped by signal (received by rank {signalled}) after step {step}", flush=True)
                break
    finally:
        stop.restore()
        log.close()
    log.finish(step)
    return result


class _StepLog:
    """Rank 0's progress line and ``train.metrics_file``, the result's losses and norms, and the summary."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, rank0: bool, result: TrainResult) -> None:
        t = cfg.train
        self.cfg, self.mesh, self.rank0, self.result = cfg, mesh, rank0, result
        self.metrics_file = _open_metrics_file(t.metrics_file, rank0)
        self.progress = Progress(t.steps, enabled=rank0, every=t.log_every, start_step=result.start_step)
        self.tokens_per_step = t.global_batch * cfg.data.seq_len
        self.flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
        self.peak = job_peak_flops(cfg, mesh)
        self.start = time.perf_counter()

    def record(self, step: int, loss: float, grad_norm: float, lr: float, router: dict | None = None) -> None:
        self.result.losses.append(loss)
        self.result.grad_norms.append(grad_norm)
        rate = self.tokens_per_step * (step - self.result.start_step) / (time.perf_counter() - self.start)
        fields = {"loss": f"{loss:.4f}", "tok/s": format_rate(rate), "lr": f"{lr:.1e}"}
        mfu = self.flops_per_token * rate / self.peak if self.peak else None
        if mfu is not None:
            fields["mfu"] = f"{100 * mfu:.1f}%"
        if router is not None:  # an MoE model: the worst router's tokens per expert, max / mean, global
            fields["experts"] = format_router_health(router)
        self.progress.update(step, **fields)
        if self.metrics_file:
            record = dict(step=step, loss=loss, grad_norm=grad_norm, lr=lr, tokens_per_s=rate, mfu=mfu)
            if router is not None:
                record.update(
                    expert_imbalance=router["imbalance"],
                    expert_imbalance_per_router=router["per_router"],
                    dropped_tokens=router["dropped"],
                )
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()

    def close(self) -> None:
        if self.metrics_file:
            self.metrics_file.close()

    def finish(self, step: int) -> None:
        """Fill in the result's totals; rank 0 prints the summary."""
        result, steps = self.result, self.cfg.train.steps
        result.seconds = time.perf_counter() - self.start
        result.steps = step - result.start_step
        result.tokens_per_s = self.tokens_per_step * result.steps / result.seconds if result.steps else 0.0
        if self.rank0 and result.losses:
            first, last = result.losses[0], result.losses[-1]
            per_rank = format_rate(result.tokens_per_s / self.mesh.size())
            print(
                f"done: {result.steps} steps in {format_duration(result.seconds)} | loss {first:.4f} -> {last:.4f} | "
                f"{format_rate(result.tokens_per_s)} tok/s global, {per_rank} per rank",
                flush=True,
            )
        elif self.rank0 and result.start_step >= steps:
            print(
                f"done: nothing to train: resumed at step {result.start_step}, and train.steps={steps}; "
                "raise train.steps to train further",
                flush=True,
            )
