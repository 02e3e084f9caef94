"""The mixed-precision rule: who casts, on a resolved mesh. One home for the trainer, the pipeline runtime, the
Accelerator, the bench and the planner.

With FSDP (``dp_shard x cp > 1``) FSDP2's policy casts (bf16/fp16 parameters and compute, fp32 gradient
reduction); without FSDP the forward runs under ``torch.autocast(bf16)``, and fp16 is refused (it would need
a loss scaler, which ndparallel does not have). docs/training.md.

Master weights follow 🤗 Accelerate's FSDP rule (:func:`master_dtype`): where FSDP applies mixed precision,
trainable bf16/fp16 parameters are upcast to fp32 master weights (the optimizer steps fp32 tensors, FSDP
casts them down for compute); elsewhere they train in their own dtype, and updates below its resolution
are lost (:func:`master_weights_message` says which, once).
"""

from __future__ import annotations

import dataclasses

import torch

from ndparallel.config.dims import fsdp_shards
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = [
    "LOW_PRECISION",
    "forward_autocast_dtype",
    "master_dtype",
    "master_weights_message",
    "parallelize_config",
    "stored_dtype_fits",
]

# The one name -> dtype table: parameter dtypes (model.dtype) and mixed-precision compute dtypes ("no": none).
DTYPES: dict[str, torch.dtype | None] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "no": None,
}


LOW_PRECISION = (torch.bfloat16, torch.float16)


def master_dtype(dtype: torch.dtype, cfg: ParallelismConfig) -> torch.dtype:
    """The dtype a trainable parameter stored in ``dtype`` trains in on the resolved mesh ``cfg``: fp32 for
    bf16/fp16 where FSDP casts (``mixed_precision`` bf16/fp16 and ``dp_shard_size x cp_size > 1``), as
    Accelerate upcasts them; its own dtype otherwise."""
    if dtype in LOW_PRECISION and cfg.mixed_precision != "no" and fsdp_shards(cfg):
        return torch.float32
    return dtype


def master_weights_message(low: dict[torch.dtype, int], cfg: ParallelismConfig) -> tuple[bool, str] | None:
    """What to tell about ``low`` (trainable low-precision dtype -> parameter count) on ``cfg``: ``(True, line)``
    when they are upcast (a log line), ``(False, line)`` when they train as stored (a warning); None if none."""
    if not low:
        return None
    names = ", ".join(f"{count} {str(dtype).removeprefix('torch.')}" for dtype, count in low.items())
    if all(master_dtype(dtype, cfg) == torch.float32 for dtype in low):
        return True, (
            f"mixed_precision={cfg.mixed_precision!r} under FSDP: {names} trainable parameters upcast to fp32 "
            "master weights (FSDP computes in the low precision); checkpoints hold fp32"
        )
    return False, (
        f"{names} trainable parameters train without fp32 master weights: updates below their resolution are "
        "lost. Load the model in float32, or use mixed_precision='bf16' with dp_shard_size x cp_size > 1 "
        "(then they are upcast to fp32)"
    )


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


def stored_dtype_fits(stored: str, dtype: torch.dtype) -> bool:
    """Whether a safetensors header dtype (``F32``, ``BF16``, ``F8_E4M3``, ``I64``, ``U8``, ``BOOL``, ``C64``) is of
    the kind of ``dtype``: another float width is a cast, but the bytes of a float weight declared ``I32`` would
    be read as integers and cast one by one (other numbers, no error)."""
    kind = "float" if stored.startswith(("F", "BF")) else "int" if stored.startswith(("I", "U")) else stored
    kind = "complex" if stored.startswith("C") else "bool" if stored == "BOOL" else kind
    if dtype.is_complex:
        return kind == "complex"
    if dtype.is_floating_point:
        return kind == "float"
    return kind == ("bool" if dtype == torch.bool else "int")
