"""Master weights: trainable bf16/fp16 parameters upcast to fp32 where FSDP applies mixed precision, as 🤗
Accelerate does; the rule is :func:`ndparallel.config.precision.master_dtype`. Without it an optimizer steps
the bf16 tensors themselves and most small updates round away (docs/accelerate-migration.md measures it)."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.precision import LOW_PRECISION, master_dtype, master_weights_message

__all__ = ["apply_master_weights"]

_LOG = logging.getLogger("ndparallel")


def apply_master_weights(model: nn.Module, cfg: ParallelismConfig) -> None:
    """Cast ``model``'s trainable parameters to their master dtype in place (same Parameter objects, so an
    optimizer built before keeps them); log the upcast, or warn once when low-precision ones stay."""
    low: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.requires_grad and param.dtype in LOW_PRECISION:
            low[param.dtype] = low.get(param.dtype, 0) + 1
            target = master_dtype(param.dtype, cfg)
            if target != param.dtype:
                param.data = param.data.to(target)
    message = master_weights_message(low, cfg)
    if message is None:
        return
    upcast, line = message
    if not upcast:
        warnings.warn(line, stacklevel=3)
    elif not dist.is_initialized() or dist.get_rank() == 0:
        _LOG.warning(line)
