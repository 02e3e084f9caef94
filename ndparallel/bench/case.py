"""One benchmark configuration: model shape, mesh shape, sequence length, global batch and micro-batch.

A case is checked by the job pre-flight that ``ndparallel train`` and ``ndparallel plan`` use too
(:mod:`ndparallel.config.preflight`) before any process starts: the bench measures what the trainer would run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.preflight import JobShape, check_job
from ndparallel.errors import ConfigError
from ndparallel.models import TransformerConfig

__all__ = ["BenchCase"]


@dataclass
class BenchCase:
    """One configuration to measure. ``parallelism`` holds :class:`ParallelismConfig` fields (no ``-1``)."""

    sweep: str
    label: str
    model: dict[str, Any]
    parallelism: dict[str, Any]
    seq_len: int
    global_batch: int
    warmup: int = 2
    steps: int = 5
    device: str = "cpu"
    compute_twin: bool = True
    """Also run the compute-only twin (fake process group) to measure exposed communication."""
    micro_batch: int | None = None
    """Sequences per rank per forward (``train.micro_batch``); default the whole per-rank batch."""
    defer_grad_sync: bool | None = None
    """``train.defer_grad_sync``: under FSDP, sync gradients on the last micro-batch only (unset: every
    micro-batch, except under pp, where only deferral exists)."""

    @property
    def pp_size(self) -> int:
        return int(self.parallelism.get("pp_size", 1))

    def pipeline_shape(self) -> Any:
        """The estimator's ``MeshShape`` of this case (pp knobs included), for the bubble column."""
        from ndparallel.estimate import MeshShape

        return MeshShape.from_config(self.parallel_config())

    def parallel_config(self) -> ParallelismConfig:
        """The case's config, resolved (sizes must be explicit: a case is one mesh shape)."""
        cfg = ParallelismConfig.from_dict(self.parallelism)
        if -1 in cfg.sizes.values():
            raise ConfigError(f"bench case {self.name}: sizes must be explicit (no -1), got {cfg.sizes}")
        return cfg.resolve(cfg.world_size)

    def model_config(self) -> TransformerConfig:
        return TransformerConfig.from_dict(self.model)

    @property
    def name(self) -> str:
        return f"{self.sweep}/{self.label}"

    @property
    def world_size(self) -> int:
        return self.parallel_config().world_size

    def accumulation_steps(self) -> int:
        """Micro-batches per step on each rank (under pp the pipeline's), by the trainer's own pre-flight
        (:func:`ndparallel.config.preflight.check_job`); a case the trainer would refuse raises its message."""
        job = JobShape(self.global_batch, self.seq_len, self.micro_batch, self.defer_grad_sync)
        try:
            return check_job(self.parallel_config(), job, self.model_config().preflight_shape())
        except ConfigError as err:
            raise ConfigError(f"bench case {self.name}: {err}") from None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def validate(self) -> None:
        """Raise ConfigError for a case that cannot run (checked before any process starts)."""
        for name in ("seq_len", "global_batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"bench case {self.name}: {name}={value!r} must be a positive integer")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"bench case {self.name}: warmup={self.warmup!r} must be an integer >= 0")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"bench case {self.name}: device={self.device!r} must be cpu or cuda")
        if self.micro_batch is not None and (
            not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool) or self.micro_batch < 1
        ):
            raise ConfigError(f"bench case {self.name}: micro_batch={self.micro_batch!r} must be a positive integer")
        self.accumulation_steps()  # the job pre-flight: what ndparallel train would refuse, refused here

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
