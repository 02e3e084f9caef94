"""DDP's ``broadcast_buffers`` for the Accelerator's plain data parallel: before every forward, each buffer of the
prepared model (BatchNorm's running statistics, ...) takes the first data rank's value, as
``DistributedDataParallel(broadcast_buffers=True)`` (Accelerate's default) does. Without it the ranks' running
statistics drift apart and evaluation differs between ranks and from Accelerate's run.
``DistributedDataParallelKwargs(broadcast_buffers=False)`` turns it off."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["broadcast_buffers_each_forward"]


def broadcast_buffers_each_forward(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Register the forward pre-hook on ``model`` (nothing when it has no buffers or the group is one rank)."""
    buffers = [b for b in model.buffers() if not b.is_meta]
    if not buffers or dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)

    def broadcast(module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            for buffer in buffers:
                dist.broadcast(buffer, src=source, group=group)

    model.register_forward_pre_hook(broadcast)
