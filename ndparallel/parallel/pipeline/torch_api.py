"""The one place that touches ``torch.distributed.pipelining``: stage and schedule construction.

Only public classes are used. ``PipelineStage``'s ``group`` is passed by keyword: it is the 7th positional
parameter on torch 2.11 and the 9th from 2.12 on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ndparallel.config.pipeline import schedule_spec

__all__ = ["make_schedule", "make_stage"]


def make_stage(module: nn.Module, stage_id: int, n_stages: int, device: torch.device, group: dist.ProcessGroup):
    """A ``PipelineStage`` of ``module`` (shapes inferred on the first step)."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(module, stage_id, n_stages, device, group=group)


def make_schedule(name: str, stages: Sequence, microbatches: int, loss_fn: Callable):
    """torch's schedule ``name`` over this rank's ``stages``; ``scale_grads`` (the default) divides the summed
    micro-batch gradients by the micro-batch count, after FSDP's reduce-scatter."""
    import torch.distributed.pipelining as pipelining

    spec = schedule_spec(name)
    cls = getattr(pipelining, spec.torch_class)
    return cls(list(stages) if spec.multi_stage else stages[0], microbatches, loss_fn=loss_fn)
