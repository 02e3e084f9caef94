"""One benchmark configuration: model shape, mesh shape, sequence length, global batch and micro-batch.

A case is checked by the trainer's rules (batch split, sequence length, tp, mixed precision) before any
process starts: the bench measures what ``ndparallel train`` would run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ndparallel.config import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.pp_rules import check_defer_grad_sync
from ndparallel.precision import forward_autocast_dtype
from ndparallel.sequence import check_sequence_length
from ndparallel.train.config import split_batch

__all__ = ["PP_KEYS", "BenchCase"]

PP_KEYS = ("pp_size", "pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_split")
"""The pipeline fields of ``ParallelismConfig`` (PP_CONTRACT.md)."""


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

        cfg, p = self.parallel_config(), self.parallelism
        return MeshShape(
            cfg.dp_replicate_size, cfg.dp_shard_size, cfg.cp_size, cfg.tp_size, self.pp_size,
            p.get("pp_schedule", "1f1b"), p.get("pp_microbatches") or 0, p.get("pp_stages_per_rank") or 0,
        )  # fmt: skip

    def parallel_config(self) -> ParallelismConfig:
        """The case's config; without pp support in this build, of the mesh without pp (``world_size`` still
        counts the pp ranks)."""
        fields = self.parallelism
        if "pp_size" not in ParallelismConfig.__dataclass_fields__:
            fields = {k: v for k, v in fields.items() if k not in PP_KEYS}
        cfg = ParallelismConfig.from_dict(fields)
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
        cfg = self.parallel_config()
        return cfg.world_size * (self.pp_size if "pp" not in cfg.sizes else 1)

    def accumulation_steps(self) -> int:
        """Micro-batches per step on each rank (the trainer's rule; under pp the pipeline's ``pp_microbatches``)."""
        cfg = self.parallel_config()
        if self.pp_size > 1 and self.parallelism.get("pp_microbatches"):
            return int(self.parallelism["pp_microbatches"])
        return split_batch(self.global_batch, self.micro_batch, cfg.dp_replicate_size * cfg.dp_shard_size,
                           prefix=f"bench case {self.name}: ")  # fmt: skip

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def validate(self) -> None:
        """Raise ConfigError for a case that cannot run (checked before any process starts)."""
        cfg, mcfg = self.parallel_config(), self.model_config()
        for name in ("seq_len", "global_batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"bench case {self.name}: {name}={value!r} must be a positive integer")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"bench case {self.name}: warmup={self.warmup!r} must be an integer >= 0")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"bench case {self.name}: device={self.device!r} must be cpu or cuda")
        if self.seq_len > mcfg.max_seq_len:
            raise ConfigError(
                f"bench case {self.name}: seq_len={self.seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}; "
                f"set model.max_seq_len >= {self.seq_len}"
            )
        if self.micro_batch is not None and (
            not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool) or self.micro_batch < 1
        ):
            raise ConfigError(f"bench case {self.name}: micro_batch={self.micro_batch!r} must be a positive integer")
        if not isinstance(self.pp_size, int) or self.pp_size < 1:
            raise ConfigError(f"bench case {self.name}: pp_size={self.pp_size!r} must be a positive integer")
        if self.pp_size > 1:
            self._validate_pipeline(mcfg)
            check_defer_grad_sync(self.defer_grad_sync, cfg, f"bench case {self.name}: defer_grad_sync")
        self.accumulation_steps()  # raises for a batch split the trainer would refuse
        forward_autocast_dtype(cfg)  # the trainer's precision rule: fp16 needs FSDP
        check_sequence_length(
            self.seq_len, cfg.cp_size, cfg.tp_size, cfg.cp_load_balance, what=f"bench case {self.name}: seq_len"
        )
        if cfg.tp_size > 1:
            from ndparallel.plans.tensor_parallel import check_tp_divisibility

            with torch.device("meta"):
                check_tp_divisibility(Transformer(mcfg), cfg.tp_size)

    def _validate_pipeline(self, mcfg: TransformerConfig) -> None:
        """The planner's pp rules (``ndparallel.estimate.search.pipeline_problems``: the config's own validation
        once it has the pp fields, and torch's schedule limits)."""
        from ndparallel.estimate import ModelSpec, TrainingSpec
        from ndparallel.estimate.search import pipeline_problems

        cfg = self.parallel_config()
        precision = "fp32" if cfg.mixed_precision == "no" else cfg.mixed_precision
        train = TrainingSpec(
            global_batch=self.global_batch, seq_len=self.seq_len, micro_batch=self.micro_batch or 1,
            precision=precision, activation_checkpointing=cfg.activation_checkpointing,
        )  # fmt: skip
        if self.micro_batch is None and not self.parallelism.get("pp_microbatches"):
            raise ConfigError(f"bench case {self.name}: a pp case needs pp_microbatches (or micro_batch)")
        problems = pipeline_problems(ModelSpec.from_config(mcfg), train, self.pipeline_shape())
        if problems:
            raise ConfigError(f"bench case {self.name}: {'; '.join(problems)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
