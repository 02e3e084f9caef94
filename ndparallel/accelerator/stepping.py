"""Prepared optimizers and schedulers: re-pointed at the parallelised parameters, and stepped only when
gradients sync, so an Accelerate loop that calls ``optimizer.step()`` on every micro-batch still takes one
step per accumulated batch (Accelerate's prepared optimizer skips the others the same way)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from ndparallel.errors import ConfigError

__all__ = ["GATE_ATTRIBUTE", "repoint", "scheduler_state", "step_only_when_syncing"]

GATE_ATTRIBUTE = "_ndp_steps_when_syncing"  # on a gated optimizer / scheduler: the names of the gated methods


def repoint(
    optimizer: torch.optim.Optimizer, old: dict[int, tuple[int, str]], new: list[dict[str, Any]], drop_absent=False
) -> None:
    """Replace the optimizer's parameters (pre-parallelize objects) by the model's current ones, by name.
    ``drop_absent`` (pipeline parallel): a parameter this rank's stages do not hold leaves the optimizer (its
    group stays, possibly empty, so LR schedulers keep their group indices)."""
    if optimizer.state:
        raise ConfigError("prepare() the optimizer before its first step (it already holds state)")
    for group in optimizer.param_groups:
        replaced = []
        for param in group["params"]:
            if id(param) not in old:
                replaced.append(param)
                continue
            model_index, name = old[id(param)]
            if name in new[model_index] or not drop_absent:
                replaced.append(new[model_index][name])
        group["params"] = replaced


def step_only_when_syncing(obj: Any, methods: tuple[str, ...], syncing: Callable[[], bool]) -> None:
    """Make ``obj.<method>()`` a no-op (returning None) while ``syncing()`` is false; patched on the instance,
    so ``obj`` keeps its type and its state dict. The patch is a bound method: torch's LR schedulers wrap
    ``optimizer.step`` through its ``__func__``."""
    if getattr(obj, GATE_ATTRIBUTE, False):
        return
    for name in methods:
        original = getattr(obj, name)

        @functools.wraps(original)
        def gated(self: Any, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            return _original(*args, **kwargs) if syncing() else None

        setattr(obj, name, types.MethodType(gated, obj))
    setattr(obj, GATE_ATTRIBUTE, methods)


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """``scheduler.state_dict()`` without the gate patched on the instance (torch's LR schedulers return their
    ``__dict__``, which then holds the gated ``step``: not state, and not storable)."""
    patched = (*getattr(scheduler, GATE_ATTRIBUTE, ()), GATE_ATTRIBUTE)
    return {k: v for k, v in scheduler.state_dict().items() if k not in patched}
