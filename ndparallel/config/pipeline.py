"""The pipeline-parallel rules that need no model and no ranks: schedules, stages per rank, micro-batches.

One home for them, below :mod:`ndparallel.config.parallelism` (which calls :func:`check_pipeline_fields` from
``validate``/``resolve``) and :mod:`ndparallel.parallel.pipeline` (which asks :func:`schedule_spec`). Every error
names the field and a fix. Measured facts behind the rules are in docs/pipeline-parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ndparallel.config.dims import fsdp_shards, is_size
from ndparallel.errors import ConfigError, brief_repr

__all__ = [
    "PP_SCHEDULES",
    "ScheduleSpec",
    "check_defer_grad_sync",
    "check_microbatches",
    "check_pipeline_fields",
    "check_pp_split",
    "check_stages_per_rank",
    "schedule_spec",
    "stages_fit_blocks",
    "stages_per_pp_rank",
    "stages_per_rank",
    "stages_problem",
    "torch_compiles_pipeline_stages",
    "torch_supports_v_schedules",
]


@dataclass(frozen=True)
class ScheduleSpec:
    """One of torch's schedules: its class name, how stages sit on ranks, its micro-batch rule."""

    torch_class: str
    style: str  # "loop": rank r holds stages r, r+p, ...; "v": rank r holds stages r and 2p-1-r
    multi_stage: bool  # the torch class takes a list of stages (else exactly one)
    min_microbatches_is_stages: bool  # torch refuses fewer micro-batches than stages
    interleaved_rule: bool  # m % max(1, m // pp) == 0


PP_SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "loop", False, False, False),
    "1f1b": ScheduleSpec("Schedule1F1B", "loop", False, True, False),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "loop", True, False, True),
    "looped_bfs": ScheduleSpec("ScheduleLoopedBFS", "loop", True, False, False),
    "interleaved_zb": ScheduleSpec("ScheduleInterleavedZeroBubble", "loop", True, False, True),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", "v", True, False, False),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", "v", True, True, False),
}


def _torch_at_least(major: int, minor: int, version: str | None) -> bool:
    text = (version or torch.__version__).split("+")[0]
    found = tuple(int(part) for part in text.split(".")[:2])
    return found >= (major, minor)


def torch_supports_v_schedules(version: str | None = None) -> bool:
    """ZBV / DualPipeV: torch 2.11's stage warm-up sends to its own rank, which gloo cannot do (measured:
    "Pair is not connected" at the first step); 2.12 replaced that warm-up. So: torch >= 2.12."""
    return _torch_at_least(2, 12, version)


def torch_compiles_pipeline_stages(version: str | None = None) -> bool:
    """``compile`` under pp: on torch 2.11 the last stage's compiled backward fails at the first step (measured,
    float64 pp 2 1F1B: "expected scalar type Double but found Float"); exact on 2.13 and 2.14. So: torch >= 2.12."""
    return _torch_at_least(2, 12, version)


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of ``pp_schedule=name`` (a ConfigError for an unknown name)."""
    if name not in PP_SCHEDULES:
        raise ConfigError(f"pp_schedule={name!r} is not one of {list(PP_SCHEDULES)}")
    return PP_SCHEDULES[name]


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """``pp_stages_per_rank`` resolved: None -> 1 for gpipe/1f1b, 2 otherwise."""
    if requested is not None:
        return requested
    return 2 if schedule_spec(schedule).multi_stage else 1


def stages_per_pp_rank(pp_size: int, schedule: str, requested: int | None) -> int:
    """Stages each pp rank holds in a resolved config: 1 without pp (the knob is then unused), else
    :func:`stages_per_rank`."""
    return 1 if pp_size == 1 else stages_per_rank(schedule, requested)


def stages_fit_blocks(n_stages: int, n_blocks: int) -> bool:
    """Every pipeline stage needs a block: no more stages than the model has blocks."""
    return n_stages <= n_blocks


def stages_problem(pp_size: int, per_rank: int, n_blocks: int, blocks_field: str = "model.n_layers") -> str | None:
    """Why ``pp_size x per_rank`` stages cannot split ``n_blocks`` blocks (:func:`stages_fit_blocks`), or None."""
    n_stages = pp_size * per_rank
    if stages_fit_blocks(n_stages, n_blocks):
        return None
    return (
        f"pp_size={pp_size} x pp_stages_per_rank={per_rank} = {n_stages} pipeline stages but "
        f"{blocks_field}={n_blocks}: every stage needs a block; use fewer stages or more layers"
    )


def check_stages_per_rank(schedule: str, per_rank: int) -> None:
    """Refuse a ``pp_stages_per_rank`` the schedule cannot run (V: exactly 2; looped: >= 2; single-stage: 1)."""
    spec = schedule_spec(schedule)
    if spec.style == "v" and per_rank != 2:
        raise ConfigError(
            f"pp_stages_per_rank={per_rank} does not fit pp_schedule={schedule!r}: V schedules place exactly 2 "
            "stages on each rank; set pp_stages_per_rank=2 (or leave it unset)"
        )
    if spec.multi_stage and per_rank < 2:
        raise ConfigError(
            f"pp_stages_per_rank={per_rank} does not fit pp_schedule={schedule!r}: a looped schedule needs at least "
            "2 stages per rank; set pp_stages_per_rank >= 2, or use pp_schedule=1f1b / gpipe for one stage per rank"
        )
    if not spec.multi_stage and per_rank != 1:
        raise ConfigError(
            f"pp_stages_per_rank={per_rank} does not fit pp_schedule={schedule!r}, which runs one stage per rank; "
            "set pp_stages_per_rank=1, or use pp_schedule=interleaved_1f1b for several"
        )


def check_microbatches(schedule: str, microbatches: int, pp_size: int, per_rank: int, field: str) -> None:
    """The schedule's micro-batch rule (``field`` names where the count came from)."""
    spec = schedule_spec(schedule)
    n_stages = pp_size * per_rank
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ConfigError(f"{field}={brief_repr(microbatches)} must be a positive integer")
    if spec.min_microbatches_is_stages and microbatches < n_stages:
        raise ConfigError(
            f"{field}={microbatches} is fewer than the {n_stages} pipeline stages that pp_schedule={schedule!r} "
            f"needs; use at least {n_stages}"
        )
    if spec.interleaved_rule and microbatches % max(1, microbatches // pp_size):
        raise ConfigError(
            f"{field}={microbatches} does not fit pp_schedule={schedule!r} on pp_size={pp_size}: torch needs "
            f"micro-batches % max(1, micro-batches // pp_size) == 0; use a multiple of {pp_size}"
        )


def check_pp_split(split: Any, n_stages: int | None = None, n_blocks: int | None = None) -> None:
    """``pp_split``: one ``[first, last)`` block range per stage, contiguous from block 0, each non-empty."""
    if split is None:
        return
    shape_ok = isinstance(split, (list, tuple)) and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        for r in split
    )
    if not shape_ok or not split:
        raise ConfigError(
            f"pp_split={brief_repr(split)} must be a list of [first, last) block ranges, e.g. [[0, 3], [3, 8]]"
        )
    expected = 0
    for first, last in split:
        if first != expected or last <= first:
            raise ConfigError(
                f"pp_split={brief_repr(split)}: ranges must be non-empty, contiguous and start at block 0 "
                f"(the range starting at {first} should start at {expected} and end after it)"
            )
        expected = last
    if n_stages is not None and len(split) != n_stages:
        raise ConfigError(
            f"pp_split has {len(split)} ranges but there are {n_stages} stages (pp_size x pp_stages_per_rank); "
            "give one range per stage"
        )
    if n_blocks is not None and expected != n_blocks:
        raise ConfigError(
            f"pp_split={brief_repr(split)} covers blocks 0..{expected - 1} but the model has {n_blocks} blocks"
        )


# Zero-bubble schedules: backward split into an input pass and a deferred weight pass (measured under FSDP's
# mixed-precision policy: step-1 weight gradients up to 3e-3 relative off 1f1b's, i.e. summed at bf16 resolution;
# docs/pipeline-parallel.md).
_SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")


# What pp does not compose with (measured wrong, or no parity test yet: refused).
def _unsupported(cfg: Any) -> list[str]:
    found = []
    if cfg.mixed_precision != "no" and cfg.pp_schedule in _SPLIT_BACKWARD and fsdp_shards(cfg):
        found.append(
            f"mixed_precision={cfg.mixed_precision!r} under FSDP (dp_shard_size x cp_size > 1) on "
            f"pp_schedule={cfg.pp_schedule!r}, whose deferred weight gradients FSDP sums over micro-batches in "
            f"{cfg.mixed_precision} (use 1f1b, interleaved_1f1b or looped_bfs)"
        )
    return found


def check_defer_grad_sync(defer: bool | None, cfg: Any, field: str = "train.defer_grad_sync") -> None:
    """Under pp with FSDP torch's pipeline stage reduce-scatters once, after the last micro-batch: an explicit
    ``defer_grad_sync=False`` (sync every micro-batch) cannot be honoured and is refused; unset means deferred."""
    if defer is False and cfg.pp_size > 1 and fsdp_shards(cfg):
        raise ConfigError(
            f"{field}=false cannot be honoured with pp_size={cfg.pp_size} under FSDP: torch's pipeline stage "
            f"reduce-scatters gradients once, after the last micro-batch (docs/pipeline-parallel.md); leave {field} "
            "unset (or true)"
        )


def check_pipeline_fields(cfg: Any) -> None:
    """Types and the rules that need only the config (``pp_size`` may still be -1)."""
    schedule_spec(cfg.pp_schedule)
    for name in ("pp_microbatches", "pp_stages_per_rank"):
        value = getattr(cfg, name)
        if value is not None and not is_size(value):
            raise ConfigError(f"{name}={brief_repr(value)} must be a positive integer (or null for the default)")
    check_pp_split(cfg.pp_split)
    if cfg.pp_size == 1:
        return
    spec = PP_SCHEDULES[cfg.pp_schedule]
    if spec.style == "v" and not torch_supports_v_schedules():
        raise ConfigError(
            f"pp_schedule={cfg.pp_schedule!r} needs torch >= 2.12 (torch {torch.__version__}'s V-schedule warm-up "
            "fails on gloo); use pp_schedule=interleaved_zb or interleaved_1f1b, or upgrade torch"
        )
    if cfg.compile != "none" and not torch_compiles_pipeline_stages():
        raise ConfigError(
            f"compile={cfg.compile!r} with pp_size={cfg.pp_size} needs torch >= 2.12 (torch {torch.__version__}'s "
            "compiled stage backward fails); set compile=none, or upgrade torch"
        )
    per_rank = stages_per_rank(cfg.pp_schedule, cfg.pp_stages_per_rank)
    check_stages_per_rank(cfg.pp_schedule, per_rank)
    unsupported = _unsupported(cfg)
    if unsupported:
        raise ConfigError(
            f"pp_size={cfg.pp_size} is not supported with {', '.join(unsupported)}; set pp_size=1 or change "
            "those settings"
        )
    if cfg.pp_size == -1:
        return
    if cfg.pp_microbatches is not None:
        check_microbatches(cfg.pp_schedule, cfg.pp_microbatches, cfg.pp_size, per_rank, "pp_microbatches")
    check_pp_split(cfg.pp_split, n_stages=cfg.pp_size * per_rank)
