"""The mixed-precision rule: who casts, on a resolved mesh. One home for the trainer, the pipeline runtime, the
Accelerator, the bench and the planner.

With FSDP (``dp_shard x cp > 1``) FSDP2's policy casts (bf16/fp16 parameters and compute, fp32 gradient
reduction); without FSDP the forward runs under ``torch.autocast(bf16)``, and fp16 is refused (it would need
a loss scaler, which ndparallel does not have). docs/training.md.
"""

from __future__ import annotations

import dataclasses

import torch

from ndparallel.config.dims import fsdp_shards
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = ["forward_autocast_dtype", "parallelize_config"]

# The one name -> dtype table: parameter dtypes (model.dtype) and mixed-precision compute dtypes ("no": none).
DTYPES: dict[str, torch.dtype | None] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "no": None,
}


def forward_autocast_dtype(cfg: ParallelismConfig) -> torch.dtype | None:
    """The dtype the forward autocasts to on the resolved mesh ``cfg``: None under FSDP (its policy casts) or
    without mixed precision; bf16 otherwise. fp16 without FSDP raises :class:`ConfigError`."""
    if cfg.mixed_precision == "no" or fsdp_shards(cfg):  # FSDP's policy casts
        return None
    if cfg.mixed_precision == "fp16":
        raise ConfigError(
            "mixed_precision=fp16 without FSDP (dp_shard_size x cp_size == 1) would need a loss scaler, which "
            "ndparallel does not have: use bf16, or shard with dp_shard_size > 1"
        )
    return DTYPES[cfg.mixed_precision]


def parallelize_config(cfg: ParallelismConfig) -> ParallelismConfig:
    """``cfg`` as ``parallelize`` should get it: mixed precision left to autocast where FSDP does not cast."""
    if forward_autocast_dtype(cfg) is None:
        return cfg
    return dataclasses.replace(cfg, mixed_precision="no")
