"""Gradient communication under accumulation, whatever parallelize applied: ``no_sync`` and the micro-batch rule.

``no_sync(model)``: inside the block, backward accumulates local gradients only; the first backward after
it communicates the accumulated sum (FSDP2 reduce-scatter / HSDP all-reduce, or the bucketed all-reduce of
pure data parallel). Divide each micro-batch's loss by the number of micro-batches and the result equals
one large batch. A model without data parallelism is left alone.

``micro_batch_sync(model, last, defer)``: what ``ndparallel train``, the bench and the Accelerator do on
each micro-batch of an accumulated step (the one place that decides, docs/training.md "Gradient
accumulation"). The last micro-batch synchronises. Before it:

- FSDP / HSDP reduce-scatter every micro-batch into the sharded gradient (no unsharded gradient is kept
  between micro-batches); HSDP adds the shards up locally and all-reduces them across replicas once, on
  the last micro-batch. ``defer=True``: ``no_sync`` instead, one reduce-scatter per step for unsharded
  fp32 gradients of the whole model held in between (communication over memory).
- Pure data parallel (replicate) always defers: it holds full gradients anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ndparallel.errors import ConfigError
from ndparallel.parallel.replicate import no_sync as replicate_no_sync
from ndparallel.parallel.replicate import replicate_state

__all__ = ["micro_batch_sync", "no_sync"]


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp_switch(modules: list[FSDPModule], setter: str) -> Iterator[None]:
    """Turn one FSDP2 per-module sync switch (``set_requires_gradient_sync`` / ``set_requires_all_reduce``)
    off for the block, on again after it."""
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


def micro_batch_sync(model: nn.Module, last: bool, defer: bool = False) -> contextlib.AbstractContextManager:
    """The gradient communication of one micro-batch's backward (see the module doc).

    ``last``: the step's last micro-batch (it synchronises). ``defer``: under FSDP, keep unsharded gradients
    until the last micro-batch instead of reduce-scattering each one (``train.defer_grad_sync``).
    """
    if last:
        return contextlib.nullcontext()
    fsdp = _fsdp_modules(model)
    if fsdp and not defer:
        # Reduce-scatter now; HSDP's all-reduce across replicas waits for the last micro-batch (FSDP2 adds the
        # reduce-scattered shards up in between). Without a replicate dim the switch changes nothing.
        return _fsdp_switch(fsdp, "set_requires_all_reduce")
    return no_sync(model)
