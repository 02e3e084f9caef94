"""What one case measured, folded over its ranks: :class:`CaseResult` and :func:`combine`."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ndparallel.bench.case import BenchCase

__all__ = ["CaseResult", "combine", "pipeline_info"]


@dataclass
class CaseResult:
    """What one case measured, combined over ranks. Times in seconds, memory and comm in bytes."""

    case: dict[str, Any]
    world_size: int
    params: int
    step_s: list[float]
    """Per timed step, the slowest rank's time."""
    step_median_s: float
    step_min_s: float
    step_max_s: float
    step_stdev_s: float
    tokens_per_s: float
    tokens_per_s_per_rank: float
    model_flops_per_s: float
    mfu: float
    """Model FLOP/s / (peak FLOP/s of the devices the job used); see ``peak_flops``."""
    peak_flops: float
    memory_method: str
    peak_memory_bytes: int
    """Max over ranks."""
    peak_memory_bytes_per_rank: list[int]
    param_bytes: int
    """Parameter bytes held by one rank (its shard), max over ranks."""
    optimizer_bytes: int
    comm: list[dict[str, Any]]
    """Per (mesh dims, collective kind): calls and payload bytes in one step, on rank 0."""
    comm_bytes: int
    twin_step_median_s: float | None
    twin_step_min_s: float | None
    exposed_comm_s: float | None
    """Fastest real step - fastest compute-only twin step (the least disturbed steps of each)."""
    losses: list[float] = field(default_factory=list)
    error: str = ""
    """Why the case was not measured; its numbers are then NaN / -1, never a measurement (the report shows it)."""
    pipeline: dict[str, Any] = field(default_factory=dict)
    """pp cases: ``schedule``, ``microbatches``, ``stages_per_rank`` and the cost model's ``bubble`` fraction."""
    experts: dict[str, Any] = field(default_factory=dict)
    """MoE cases: the router health of the instrumented step (``imbalance``: the worst router's max / mean tokens
    per expert over the global batch, ``per_router`` each one's; ``dropped`` tokens; ``tokens_per_expert`` per
    router), and
    ``all_to_all_min_bytes``, the least all-to-all payload the routing needs on one rank (balanced experts)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pipeline_info(case: BenchCase) -> dict[str, Any]:
    """The pp columns of a case (empty without pp): schedule, micro-batches, stages per rank, predicted bubble."""
    if case.pp_size == 1:
        return {}
    from ndparallel.estimate.pipeline import bubble_fraction

    shape = case.pipeline_shape()
    m = shape.pp_microbatches or case.accumulation_steps()
    return {"pp": shape.pp, "schedule": shape.pp_schedule, "microbatches": m,
            "stages_per_rank": shape.stages_per_rank, "bubble": bubble_fraction(shape, m)}  # fmt: skip


def combine(case: BenchCase, ranks: list[dict[str, Any]], twins: list[list[float] | None], peak_flops: float):
    """Fold per-rank measurements of one case into a :class:`CaseResult`."""
    world = len(ranks)
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    median = statistics.median(step_s)
    mcfg = case.model_config()
    tokens_per_s = case.tokens_per_step / median
    flops_per_s = tokens_per_s * mcfg.flops_per_token(case.seq_len)
    device_peak = peak_flops if case.device == "cpu" else peak_flops * world  # CPU ranks share one machine
    twin_steps = [t for t in twins if t]
    twin_step_s = [max(s) for s in zip(*twin_steps, strict=True)] if twin_steps else None
    twin_median = statistics.median(twin_step_s) if twin_step_s else None
    twin_min = min(twin_step_s) if twin_step_s else None
    if world == 1:
        twin_median, twin_min = median, min(step_s)  # nothing to expose on one rank
    comm = ranks[0].get("comm", [])
    return CaseResult(
        case=case.to_dict(),
        world_size=world,
        params=mcfg.num_params(),
        step_s=step_s,
        step_median_s=median,
        step_min_s=min(step_s),
        step_max_s=max(step_s),
        step_stdev_s=statistics.stdev(step_s) if len(step_s) > 1 else 0.0,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_rank=tokens_per_s / world,
        model_flops_per_s=flops_per_s,
        mfu=flops_per_s / device_peak if device_peak and not math.isnan(device_peak) else float("nan"),
        peak_flops=device_peak,
        memory_method=ranks[0].get("memory_method", ""),
        peak_memory_bytes=max(r.get("peak_memory_bytes", -1) for r in ranks),
        peak_memory_bytes_per_rank=[r.get("peak_memory_bytes", -1) for r in ranks],
        param_bytes=max(r.get("param_bytes", 0) for r in ranks),
        optimizer_bytes=max(r.get("optimizer_bytes", 0) for r in ranks),
        comm=comm,
        comm_bytes=sum(row["bytes"] for row in comm),
        twin_step_median_s=twin_median,
        twin_step_min_s=twin_min,
        exposed_comm_s=None if twin_min is None else min(step_s) - twin_min,
        losses=ranks[0]["losses"],
        pipeline=pipeline_info(case),
        experts=ranks[0].get("experts", {}),
    )
