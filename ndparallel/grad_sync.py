"""Gradient communication under accumulation, whatever parallelize applied: ``no_sync`` and the micro-batch rule.

``no_sync(model)``: inside the block, backward accumulates local gradients only; the first backward after
it communicates the accumulated sum (FSDP2 reduce-scatter / HSDP all-reduce, or the bucketed all-reduce of
pure data parallel). Divide each micro-batch's loss by the number of micro-batches and the result equals
one large batch. A model without data parallelism is left alone.

``micro_batch_sync(model, last)``: what ``ndparallel train``, the bench and the Accelerator do on each
micro-batch of an accumulated step (the one place that decides): the last micro-batch synchronises, the
ones before it run under ``no_sync``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ndparallel.errors import ConfigError
from ndparallel.plans.replicate import no_sync as replicate_no_sync
from ndparallel.plans.replicate import replicate_state

__all__ = ["micro_batch_sync", "no_sync"]


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp_switch(modules: list[FSDPModule], setter: str) -> Iterator[None]:
    """Turn one FSDP2 per-module sync switch (``set_requires_gradient_sync``) off for the block, on again after it."""
    for module in modules:
        getattr(module, setter)(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            getattr(module, setter)(True, recurse=False)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Context manager: backward passes inside it do not synchronise gradients across ranks."""
    fsdp = _fsdp_modules(model)
    if fsdp:
        with _fsdp_switch(fsdp, "set_requires_gradient_sync"):
            yield
        return
    try:
        replicate_state(model)
    except ConfigError:
        yield  # no data-parallel communication to skip
        return
    with replicate_no_sync(model):
        yield


def micro_batch_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """The gradient communication of one micro-batch's backward: ``last`` (the step's last micro-batch)
    synchronises; the others accumulate locally under :func:`no_sync`."""
    return contextlib.nullcontext() if last else no_sync(model)
