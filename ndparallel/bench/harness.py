"""Run one benchmark configuration on N ranks and measure it.

A :class:`BenchCase` is a model shape, a mesh shape (any :class:`ParallelismConfig` fields), a
sequence length and a global batch. :func:`run_cases` runs cases either on simulated gloo ranks
(``ndparallel.testing.run_distributed``: one spawned group per world size) or, when the process is
already one rank of a torchrun job (``ndparallel launch ... -- bench``), on that job's ranks.

Per rank, per case (the training step ``ndparallel train`` runs, :class:`ndparallel.train.step.TrainStep`:
micro-batches with its gradient-sync rule, forward under its precision rule, cross-entropy, backward,
global-norm clipping, the non-finite agreement, AdamW):

1. ``warmup`` untimed steps, a barrier, then ``steps`` timed steps (CUDA: synchronised). The step
   time of the job is, per step, the slowest rank's.
2. One instrumented step: collectives counted by :class:`ndparallel.distributed.counter.CommCounter`
   (calls and payload bytes per collective kind and process group, mapped back to mesh dims),
   and on CPU the peak of live tensor bytes by :class:`ndparallel.bench.memory.LiveMemory`
   (on CUDA the allocator's ``max_memory_allocated`` over the timed steps).
3. After every case has run: the *compute-only twin*. The process group is replaced by torch's
   ``fake`` backend (every collective returns at once, moving nothing) and each case runs again
   with identical per-rank shapes, on the same number of concurrently running ranks. Exposed
   communication = step time - twin step time: the communication time that compute did not hide
   (plus any waiting on slower ranks), taken between the *fastest* step of each run, the step least
   disturbed by other processes. On an oversubscribed CPU both runs share the cores the same way, so
   the difference is communication, not contention; load from other processes still adds noise.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.bench.case import BenchCase
from ndparallel.bench.result import CaseResult, combine
from ndparallel.config.dims import MESH_DIMS
from ndparallel.distributed.mesh import EP_VIEWS, VIEWS, Mesh
from ndparallel.distributed.process import init_distributed
from ndparallel.models import Transformer

__all__ = ["BenchCase", "CaseResult", "group_labels", "inside_launcher", "measure_cases_on_rank", "run_cases"]


# ------------------------------------------------------------------------------------ one rank


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Job:
    """Model, optimizer, the trainer's step and this rank's fixed batch for one case on one mesh."""

    def __init__(self, case: BenchCase, mesh: Mesh, twin: bool = False):
        from ndparallel.config.precision import parallelize_config
        from ndparallel.parallel.parallelize import parallelize
        from ndparallel.train.step import TrainStep

        self.case, self.mesh, self.device = case, mesh, mesh.device
        mcfg = case.model_config()
        if case.pp_size > 1:
            self.model, self.optimizers, self.train_step = _pipeline_parts(case, mesh, twin)
        else:
            with self.device:
                model = Transformer(mcfg)
            self.model = parallelize(model, parallelize_config(mesh.config), mesh=mesh)
            fused = self.device.type == "cuda"
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
            self.optimizers = [optimizer]
            # The compute-only twin's collectives move nothing, so its gradients are garbage: it skips the
            # non-finite check (which would stop it) and steps every time, as the real run does.
            self.train_step = TrainStep(
                self.model, optimizer, mesh, defer_grad_sync=bool(case.defer_grad_sync), check_finite=not twin
            )
        self.accumulation = case.accumulation_steps()
        self.steps_taken = 0
        # The same global batch for every mesh shape (this rank takes its dp slice), so the losses of
        # one sweep's cases must agree: a built-in check that every shape trains the same model.
        dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
        generator = torch.Generator().manual_seed(1000)
        tokens = torch.randint(mcfg.vocab_size, (case.global_batch, case.seq_len + 1), generator=generator)
        local = case.global_batch // dp
        self.tokens = tokens[dp_rank * local : (dp_rank + 1) * local].to(self.device)

    def step(self) -> torch.Tensor:
        """One training step, exactly as ``ndparallel train`` runs it (:class:`ndparallel.train.step.TrainStep`)."""
        self.steps_taken += 1
        inputs, labels = self.tokens[:, :-1].clone(), self.tokens[:, 1:].clone()
        self.last = self.train_step(inputs, labels, self.accumulation, self.steps_taken)
        return self.last.loss

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        states = [state for opt in self.optimizers for state in opt.state.values()]
        return [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + self._optimizer_tensors()

    def optimizer_bytes(self) -> int:
        from ndparallel.bench.memory import state_bytes

        return state_bytes(self._optimizer_tensors())


def _pipeline_parts(case: BenchCase, mesh: Mesh, twin: bool) -> tuple[torch.nn.Module, list, Any]:
    """A pp case: the contract's ``build_pipeline`` on a meta-device model, one AdamW per stage module, and the
    trainer's ``TrainStep`` driving the pipeline (docs/pipeline-parallel.md)."""
    from ndparallel.parallel.pipeline import build_pipeline
    from ndparallel.train.step import TrainStep

    with torch.device("meta"):
        model = Transformer(case.model_config())
    pipe = build_pipeline(model, mesh.config, mesh)
    optimizers = [torch.optim.AdamW(stage.parameters(), lr=1e-4) for stage in pipe.stages]
    step = TrainStep(pipe, optimizers, mesh, defer_grad_sync=bool(case.defer_grad_sync), check_finite=not twin)
    return torch.nn.ModuleList(pipe.stages), optimizers, step


def _timed_steps(job: _Job) -> tuple[list[float], list[float]]:
    for _ in range(job.case.warmup):
        job.step()
    _sync(job.device)
    dist.barrier()
    if job.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.device)
    times, losses = [], []
    for _ in range(job.case.steps):
        start = time.perf_counter()
        loss = job.step()
        _sync(job.device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
    # Each rank's loss is the mean over its own tokens: average over dp x cp (after the timed steps).
    from ndparallel.distributed.reduce import average_over

    return times, [average_over(job.mesh["dp_cp"], v) for v in losses]


def group_labels(mesh: Mesh) -> dict[str, str]:
    """Process-group name -> the mesh dims it spans (``"dp_shard"``, ``"dp_shard x cp"``, ``"world"``)."""
    labels: dict[str, str] = {}
    for name in (*MESH_DIMS, *VIEWS):
        if mesh.size(name) > 1:
            dims = [d for d in VIEWS.get(name, (name,)) if mesh.size(d) > 1]
            labels.setdefault(mesh[name].get_group().group_name, " x ".join(dims))
    if mesh.size("ep") > 1:  # the experts' groups; one that equals a dim's group shows both names
        for name in EP_VIEWS:
            if mesh.size(name) > 1:
                group = mesh[name].get_group().group_name
                labels[group] = f"{labels[group]} = {name}" if group in labels else name
    if dist.is_initialized():
        labels.setdefault(dist.group.WORLD.group_name, "world")
    return labels


def _instrumented_step(job: _Job) -> tuple[list[dict[str, Any]], int]:
    """Comm per (dims, kind) on one step; peak live tensor bytes on CPU (else -1)."""
    from ndparallel.bench.memory import LiveMemory
    from ndparallel.distributed.counter import CommCounter

    memory = LiveMemory(job.state_tensors()) if job.device.type == "cpu" else None
    counter = CommCounter()
    job.train_step.around = lambda: counter  # entered per micro-batch, and around clipping + optimizer
    try:
        with memory or contextlib.nullcontext():
            job.step()
    finally:
        job.train_step.around = contextlib.nullcontext
    _sync(job.device)
    labels = group_labels(job.mesh)
    rows: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for call in counter.calls:
        row = rows[(labels.get(call.group, call.group), call.kind)]
        row["calls"] += 1
        row["bytes"] += call.payload_bytes
        row["group_size"] = call.group_size
    comm = [{"dims": dims, "kind": kind, **row} for (dims, kind), row in sorted(rows.items())]
    return comm, (memory.peak_bytes if memory is not None else -1)


def _routing_bytes(job: _Job) -> int:
    """The least all-to-all payload one step's routing needs on this rank (0 without ep): every routed row
    (local tokens x top_k) leaves and comes back, in forward and again in backward, per MoE block."""
    if job.mesh.size("ep") == 1:
        return 0
    from ndparallel.models.transformer.moe import MoE

    mcfg = job.case.model_config()
    rows = job.tokens[:, :-1].numel() // job.mesh.size("cp") * mcfg.top_k
    precision = job.mesh.config.mixed_precision
    element = 2 if precision in ("bf16", "fp16") else mcfg.torch_dtype.itemsize
    modules = getattr(job.model, "stages", [job.model])  # under pp: this rank's stages only
    blocks = sum(isinstance(m, MoE) for module in modules for m in module.modules())
    return 4 * blocks * rows * mcfg.dim * element


def _measure(case: BenchCase, twin: bool) -> dict[str, Any]:
    """Time ``case``; the real run (not ``twin``) is also instrumented (communication, memory)."""
    from ndparallel.bench.memory import state_bytes

    mesh = init_distributed(case.parallel_config(), device_type=case.device)
    job = _Job(case, mesh, twin=twin)
    times, losses = _timed_steps(job)
    out: dict[str, Any] = {"step_s": times, "losses": losses}
    if not twin:
        if job.device.type == "cuda":
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(job.device)
            out["memory_method"] = "cuda max_memory_allocated over the timed steps"
        out["comm"], cpu_peak = _instrumented_step(job)
        loads = getattr(job.last, "router_loads", None)
        if loads:  # an MoE: the instrumented step's tokens per expert (global: every rank holds the same)
            from ndparallel.train.progress import router_health

            out["experts"] = {
                **router_health(loads),
                "tokens_per_expert": [load.tolist() for load in loads],
                "all_to_all_min_bytes": _routing_bytes(job),
            }
        if job.device.type == "cpu":
            out["peak_memory_bytes"] = cpu_peak
            out["memory_method"] = "live tensor storage bytes (TorchDispatchMode), one step"
        out["param_bytes"] = state_bytes(job.model.parameters())
        out["optimizer_bytes"] = job.optimizer_bytes()
    del job
    gc.collect()
    if case.device == "cuda":
        torch.cuda.empty_cache()
    return out


def _init_fake_process_group(rank: int, world_size: int) -> None:
    # torch's "fake" backend (collectives are no-ops) is registered by torch itself on recent
    # versions; older ones register it when the private test module is imported. Kept here alone.
    try:
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    except (ValueError, RuntimeError):
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Inside the block only: silence warnings that repeat once per rank and case and say nothing about the
    measurement."""
    # DTensor logs a warning per rank when a 2-D gradient norm reduces over two dims in turn.
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # FSDP2 on the root's output (the logits); nothing in the step changes them in place.
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            yield
    finally:
        logger.setLevel(level)


def measure_cases_on_rank(cases: list[BenchCase], progress: list[str] | None = None) -> list[dict[str, Any]]:
    """Run on every rank of an initialised job: measure each case, then the compute-only twins.

    Returns this rank's raw measurements, one dict per case. Afterwards the default process group
    is the ``fake`` one (the twins need it); results must be gathered before the twin phase, which
    ``run_cases`` does. ``progress``: one line prefix per case, printed by rank 0.
    """
    rank = dist.get_rank()
    results = []
    for i, case in enumerate(cases):
        start = time.perf_counter()
        with _quiet():
            results.append(_measure(case, twin=False))
        if rank == 0 and progress:
            median = statistics.median(results[-1]["step_s"])
            print(f"{progress[i]} {case.name}: {median * 1e3:.0f} ms/step ({time.perf_counter() - start:.0f}s)",
                  flush=True)  # fmt: skip
    return results


def measure_twins_on_rank(cases: list[BenchCase]) -> list[list[float] | None]:
    """Replace the process group by a fake one and time each case again (compute only)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wanted = [c.compute_twin and world > 1 for c in cases]
    if not any(wanted):
        return [None] * len(cases)
    dist.barrier()
    dist.destroy_process_group()
    _init_fake_process_group(rank, world)
    torch.set_flush_denormal(True)  # fake collectives leave garbage in their outputs: keep it from slowing math
    try:
        with _quiet():
            return [_measure(c, twin=True)["step_s"] if w else None for c, w in zip(cases, wanted, strict=True)]
    finally:
        torch.set_flush_denormal(False)


def _rank_main(cases: list[BenchCase], progress: list[str]) -> dict[str, Any]:
    """Entry point of a simulated rank (run_distributed): real measurements, then twins."""
    real = measure_cases_on_rank(cases, progress)
    return {"real": real, "twin": measure_twins_on_rank(cases)}


# ------------------------------------------------------------------------------------ driver


def inside_launcher() -> bool:
    """True when this process is one rank of a torchrun job (``ndparallel launch ... -- bench``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_cases(
    cases: list[BenchCase],
    peak_flops: float,
    threads_per_rank: int = 1,
    timeout_per_case: float = 300.0,
    verbose: bool = True,
) -> list[CaseResult]:
    """Measure ``cases``; results in the same order.

    Outside a launcher, cases are grouped by world size and each group runs on that many simulated
    gloo ranks (one spawned job per world size), each with ``threads_per_rank`` torch threads (1 by
    default: every shape then computes with the same per-rank thread count, and a 1-rank run does not
    fight other processes for cores with OpenMP spin-waits). Inside torchrun, every rank of the job calls this
    with the same cases; those whose world size differs from the job's are skipped, and only rank 0
    gets results (the others get ``[]``).
    """
    for case in cases:
        case.validate()
    total = len(cases)
    prefixes = {id(c): f"[{i + 1}/{total}]" for i, c in enumerate(cases)}
    if inside_launcher():
        return _run_in_launcher(cases, peak_flops, prefixes)
    from ndparallel.distributed.spawn import run_distributed

    by_world: dict[int, list[BenchCase]] = defaultdict(list)
    for case in cases:
        by_world[case.world_size].append(case)
    results: dict[int, CaseResult] = {}
    for world, group in by_world.items():
        if verbose:
            print(f"-- {len(group)} case(s) on {world} simulated rank(s)", flush=True)
        progress = [prefixes[id(c)] if verbose else "" for c in group]
        timeout = timeout_per_case * len(group) * 2 + 60
        per_rank = run_distributed(
            _rank_main, world, group, progress, timeout=timeout, threads_per_rank=threads_per_rank
        )
        for i, case in enumerate(group):
            ranks = [r["real"][i] for r in per_rank]
            twins = [r["twin"][i] for r in per_rank]
            results[id(case)] = combine(case, ranks, twins, peak_flops)
    return [results[id(c)] for c in cases]


def _run_in_launcher(cases: list[BenchCase], peak_flops: float, prefixes: dict[int, str]) -> list[CaseResult]:
    world = int(os.environ["WORLD_SIZE"])
    mine = [c for c in cases if c.world_size == world]
    if int(os.environ.get("RANK", 0)) == 0:
        skipped = [c.name for c in cases if c.world_size != world]
        if skipped:
            print(f"skipping {len(skipped)} case(s) whose world size is not {world}: {', '.join(skipped)}", flush=True)
    if not mine:
        return []
    device = mine[0].device
    if not dist.is_initialized():
        init_distributed(mine[0].parallel_config(), device_type=device)
    real = measure_cases_on_rank(mine, [prefixes[id(c)] for c in mine])
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, real)
    rank = dist.get_rank()
    twins = measure_twins_on_rank(mine)  # each rank its own twin; rank 0's is reported
    if rank != 0:
        return []
    out = []
    for i, case in enumerate(mine):
        out.append(combine(case, [g[i] for g in gathered], [twins[i]], peak_flops))
    return out
