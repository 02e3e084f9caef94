"""Mixed precision for the Accelerator: FSDP2 casts where the mesh shards (dp_shard x cp > 1); elsewhere the
prepared model's forward runs under ``torch.autocast`` and returns fp32 floating outputs, as Accelerate's
``mixed_precision=`` does. Which dtype, and the refusal of fp16 without FSDP, are the training step's rule
(:func:`ndparallel.config.precision.forward_autocast_dtype`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = ["autocast_context", "merge_mixed_precision", "unwrap_autocast", "wrap_autocast"]

_MARK = "_ndp_autocast_forward"


def merge_mixed_precision(cfg: ParallelismConfig, mixed_precision: str | None) -> ParallelismConfig:
    """``cfg`` with ``Accelerator(mixed_precision=...)`` applied; a conflicting setting raises."""
    if mixed_precision is None:
        return cfg
    value = str(mixed_precision)
    if value == "fp8":
        raise ConfigError("mixed_precision='fp8' is not supported by ndparallel: use 'bf16'")
    if cfg.mixed_precision not in ("no", value):
        raise ConfigError(
            f"Accelerator(mixed_precision={value!r}) conflicts with parallelism_config.mixed_precision="
            f"{cfg.mixed_precision!r}; set one of them"
        )
    return dataclasses.replace(cfg, mixed_precision=value)


def _to_fp32(value: Any) -> Any:
    """Half-precision floating tensors inside ``value`` (tensors, tuples, lists, dicts, HF outputs) to fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, Mapping):
        for key in list(value.keys()):  # in place: keeps HF ModelOutput's attributes and class
            value[key] = _to_fp32(value[key])
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    return value


def wrap_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``model.forward`` under ``torch.autocast(device_type, dtype)``; floating outputs come back fp32."""
    if getattr(model.forward, _MARK, False):
        return
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            output = forward(*args, **kwargs)
        return _to_fp32(output)

    setattr(autocast_forward, _MARK, True)
    model.forward = autocast_forward


def unwrap_autocast(model: nn.Module) -> None:
    """Undo :func:`wrap_autocast` in place."""
    if getattr(model.forward, _MARK, False):
        model.forward = model.forward.__wrapped__


def autocast_context(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)
