"""Prepared optimizers and schedulers: re-pointed at the parallelised parameters, and stepped only when
gradients sync, so an Accelerate loop that calls ``optimizer.step()`` on every micro-batch still takes one
step per accumulated batch (Accelerate's prepared optimizer skips the others the same way).

Before anything is prepared, an optimizer must hold only the prepared models' parameters
(:func:`check_parameters`: one built from another model would step parameters no loss reaches); a
trainable parameter that no optimizer holds draws a warning (:func:`warn_unstepped`), since freezing
part of a model by leaving it out of the optimizer is legitimate, if better said with ``requires_grad_``."""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ndparallel.errors import ConfigError

__all__ = [
    "GATE_ATTRIBUTE",
    "check_parameters",
    "gate_scheduler",
    "repoint",
    "scheduler_state",
    "step_only_when_syncing",
    "warn_unstepped",
]

GATE_ATTRIBUTE = "_ndp_steps_when_syncing"  # on a gated optimizer / scheduler: the names of the gated methods


def repoint(
    optimizer: torch.optim.Optimizer,
    old: dict[int, tuple[int, str]],
    new: list[dict[str, list[Any]]],
    drop_absent: bool = False,
) -> None:
    """Replace the optimizer's parameters (pre-parallelize objects) by the model's current ones, by name.
    ``new[i]`` maps a name to every parameter now holding it: one, or under pp each copy of a weight tied
    across stages that this rank holds (each copy must step, or the copies drift apart).
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
                replaced.extend(new[model_index][name])
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


def check_parameters(optimizer: torch.optim.Optimizer, models: list[Any], plain: set[int] = frozenset()) -> None:
    """Refuse an optimizer holding a parameter that none of ``models`` (those being prepared, and those prepared
    before) holds, nor the unprepared models had (``plain``: their parameters' ids): such a parameter is not
    parallelised and gets no gradient from the prepared model (so it never changes), or no gradient sync (so
    the ranks drift apart)."""
    own = {id(p) for model in models for p in model.parameters()} | set(plain)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in params if id(p) not in own]
    if not foreign:
        return
    if len(foreign) == len(params):
        raise ConfigError(
            "the optimizer holds none of the prepared model's parameters; build it from the model you pass to "
            "prepare() (in the same call, or from the model an earlier prepare() returned)"
        )
    shapes = ", ".join(str(list(p.shape)) for p in foreign[:3])
    raise ConfigError(
        f"{len(foreign)} of the optimizer's {len(params)} parameters (shapes {shapes}...) are not the prepared "
        "model's; build it from the model you pass to prepare(), and prepare every module it trains"
    )


def warn_unstepped(models: list[Any], optimizers: list[torch.optim.Optimizer]) -> None:
    """Warn about trainable parameters of a model the optimizers train (they hold some of its parameters) that
    no optimizer holds: they get gradients and never change. A model no optimizer touches (a frozen reference
    model) is left alone; ``requires_grad_(False)`` on a parameter says it is frozen on purpose."""
    stepped = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        named = list(model.named_parameters())
        if not any(id(p) in stepped for _, p in named):
            continue
        missed = [name for name, p in named if p.requires_grad and id(p) not in stepped]
        if missed:
            warnings.warn(
                f"{len(missed)} trainable parameters of the prepared {type(model).__name__} are in no prepared "
                f"optimizer ({', '.join(missed[:3])}{', ...' if len(missed) > 3 else ''}): they get gradients but "
                "never change; add them to the optimizer, or freeze them with requires_grad_(False)",
                stacklevel=3,
            )


def _count_skipped_step(scheduler: Any) -> None:
    # torch's LRScheduler counts step() calls in the private `_step_count` (OneCycleLR stops at total_steps, and
    # the "scheduler before optimizer" warning reads it); Accelerate counts a skipped call there too.
    scheduler._step_count += 1


def gate_scheduler(scheduler: Any, syncing: Callable[[], bool], steps_per_call: int, adjust: bool) -> None:
    """Accelerate's prepared scheduler: ``step()`` does nothing while gradients do not sync (with ``adjust``, the
    call is still counted), and otherwise steps ``steps_per_call`` times: once per data rank, because each
    optimizer step consumed that many batches of the loader the schedule was sized for (one when batches are
    split over the ranks). A scheduler with ``total_steps`` (OneCycleLR) stops there."""
    if getattr(scheduler, GATE_ATTRIBUTE, False):
        return
    original = scheduler.step

    @functools.wraps(original)
    def gated(self: Any, *args: Any, **kwargs: Any) -> None:
        if not syncing():
            if adjust:
                _count_skipped_step(self)
            return
        for _ in range(steps_per_call):
            total = getattr(self, "total_steps", None)
            if total is None or self._step_count <= total:
                original(*args, **kwargs)

    scheduler.step = types.MethodType(gated, scheduler)
    setattr(scheduler, GATE_ATTRIBUTE, ("step",))
