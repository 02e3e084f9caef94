"""``no_sync(model)``: skip gradient communication for gradient accumulation, whatever parallelize applied.

Inside the block, backward accumulates local gradients only; the first backward after it
communicates the accumulated sum (FSDP2 reduce-scatter / HSDP all-reduce, or the bucketed
all-reduce of pure data parallel). Divide each micro-batch's loss by the number of micro-batches
and the result equals one large batch. A model without data parallelism is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ndparallel.errors import ConfigError
from ndparallel.plans.replicate import no_sync as replicate_no_sync
from ndparallel.plans.replicate import replicate_state

__all__ = ["no_sync"]


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Context manager: backward passes inside it do not synchronise gradients across ranks."""
    fsdp = _fsdp_modules(model)
    if fsdp:
        for module in fsdp:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in fsdp:
                module.set_requires_gradient_sync(True, recurse=False)
        return
    try:
        replicate_state(model)
    except ConfigError:
        yield  # no data-parallel communication to skip
        return
    with replicate_no_sync(model):
        yield
