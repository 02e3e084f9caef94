"""Accelerate's configuration dataclasses (``DataLoaderConfiguration``, ``ProjectConfiguration``,
``GradientAccumulationPlugin``) and kwargs handlers (``DistributedDataParallelKwargs``...), with the same fields
and defaults. A field ndparallel honours changes what it does; any other field is accepted at its default and
refused by name otherwise (:func:`check_fields`, called when the Accelerator reads them)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import Any

import torch

from ndparallel.accelerator.enums import DDPCommunicationHookType
from ndparallel.errors import ConfigError

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
    "ProjectConfiguration",
    "check_fields",
]


class KwargsHandler:
    """Base of the handlers: ``to_kwargs()`` is the fields that differ from their defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        names = [f.name for f in dataclasses.fields(self)]
        return {name: getattr(self, name) for name in names if getattr(self, name) != getattr(default, name)}


def check_fields(obj: Any, refused: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """Raise a ConfigError naming the first field of ``obj`` whose value ``refused[field][0]`` does not accept."""
    for name, (accepted, fix) in refused.items():
        value = getattr(obj, name)
        if not accepted(value):
            raise ConfigError(f"{type(obj).__name__}({name}={value!r}) is not supported by ndparallel: {fix}")


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is v or (v is not None and value == v) for v in values)


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How ``prepare()`` shards loaders: Accelerate's semantics by default (docs/accelerate-migration.md, "Data").
    ``use_seedable_sampler=True`` uses ndparallel's seeded DistributedSampler (seed ``data_seed``, default 0).
    ``dispatch_batches``: None or True dispatch an IterableDataset's stream from the first rank (Accelerate's
    default); a map-style dataset with True, or a stream with False, is refused by name at ``prepare()``."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    REFUSED = {
        "use_stateful_dataloader": (
            _is(False),
            "torchdata's StatefulDataLoader is not wrapped: resume with accelerator.skip_first_batches",
        ),
    }


@dataclasses.dataclass
class ProjectConfiguration:
    """Where ``save_state`` and the trackers write. ``automatic_checkpoint_naming``: ``save_state()`` without a
    path writes ``project_dir/checkpoints/checkpoint_<iteration>``, keeping the last ``total_limit``."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation: ``num_steps`` micro-batches per optimizer step; gradients also sync on the last
    batch of a prepared loader (``sync_with_dataloader``), or on every batch (``sync_each_batch``)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """DDP's options: ``bucket_cap_mb`` sizes ndparallel's all-reduce buckets; ``broadcast_buffers`` (every
    forward takes the first rank's buffers) is honoured; ``find_unused_parameters``, ``static_graph``,
    ``gradient_as_bucket_view`` and ``check_reduction`` change nothing computed (the reducer handles unused
    parameters itself); compression hooks are refused."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    REFUSED = {
        "dim": (_is(0), "batches are split along dim 0"),
        "comm_hook": (_is(DDPCommunicationHookType.NO, "no"), "gradients are all-reduced in full precision"),
        "comm_wrapper": (_is(DDPCommunicationHookType.NO, "no"), "gradients are all-reduced in full precision"),
        "comm_state_option": (_is({}), "no communication hook runs"),
    }


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """``timeout`` is how long a rank waits for its peers; the backend is ndparallel's (gloo on CPU, nccl on GPU)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None

    REFUSED = {
        "backend": (_is("nccl", "gloo", None), "ndparallel uses gloo for CPU tensors and nccl for CUDA ones"),
        "init_method": (_is(None), "launch with torchrun or ndparallel launch (their environment starts the group)"),
    }


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Options of ``accelerator.autocast()``; only the defaults (autocast on, torch's cache rule)."""

    enabled: bool = True
    cache_enabled: bool | None = None

    REFUSED = {
        "enabled": (_is(True), "to run without autocast, use mixed_precision='no'"),
        "cache_enabled": (_is(None), "torch's autocast cache rule is used"),
    }


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """fp16 loss scaling: ndparallel runs bf16 (no scaler) or fp16 under FSDP with fp32 gradients."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    REFUSED = {
        name: (_is(default), "ndparallel runs no GradScaler: use mixed_precision='bf16'")
        for name, default in (
            ("init_scale", 65536.0), ("growth_factor", 2.0), ("backoff_factor", 0.5), ("growth_interval", 2000),
            ("enabled", True),
        )
    }  # fmt: skip


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """``accelerator.profile()``'s torch.profiler options; a trace per rank lands in ``output_trace_dir``."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The torch profiler these options describe."""
        names = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        activities = None
        if self.activities is not None:
            unknown = [a for a in self.activities if a not in names]
            if unknown:
                raise ConfigError(f"ProfileKwargs(activities={self.activities!r}): use 'cpu' and/or 'cuda'")
            activities = [names[a] for a in self.activities]
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )
