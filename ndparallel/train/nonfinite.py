"""Stop a diverging job: a NaN/inf loss or gradient norm, agreed by every rank, never reaches the weights.

Each step every rank checks its own loss and the global gradient norm; one ``all_reduce`` of a
per-rank flag (:func:`ndparallel.distributed.agree.failed_ranks`) makes every rank take the same decision.
A bad step applies no optimizer update (so the weights stay those of the last good step, and
nothing non-finite can be saved); after
``train.max_nonfinite_steps`` bad steps in a row (default 1: the first) every rank raises
:class:`~ndparallel.errors.DivergenceError` naming the step and the ranks that saw it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from ndparallel.distributed.agree import distributed, failed_ranks, world_size
from ndparallel.errors import DivergenceError

__all__ = ["NonFiniteGuard"]


def _local_value(loss: torch.Tensor) -> float:
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    return float(local.detach().float().sum())


class NonFiniteGuard:
    """Counts consecutive steps whose loss or gradient norm is NaN/inf; raises after ``limit`` of them."""

    def __init__(self, limit: int, verbose: bool = False) -> None:
        self.limit = limit
        self.verbose = verbose  # print each skipped step (rank 0)
        self.streak = 0

    def step_is_finite(
        self, step: int, loss: torch.Tensor, grad_norm: float, cause: Callable[[], str] | None = None
    ) -> bool:
        """Collective (every rank calls it): True if every rank's loss and the gradient norm are finite.

        A False step must not be applied. Raises :class:`DivergenceError` on every rank once
        ``limit`` steps in a row were not finite. ``step`` is the 1-based number of this step. ``cause()``:
        where this rank saw it start (e.g. an MoE router's NaN logits), asked only for a bad step, locally.
        """
        value = _local_value(loss)
        bad = not (math.isfinite(value) and math.isfinite(grad_norm))
        bad_ranks = failed_ranks(bad) if distributed() and world_size() > 1 else ([0] if bad else [])
        if not bad_ranks:
            self.streak = 0
            return True
        self.streak += 1
        found = cause() if cause is not None else ""
        detail = f"loss {value:.4g}, grad norm {grad_norm:.4g}{f'; {found}' if found else ''}"
        if self.streak >= self.limit:
            fix = "Lower train.lr, check the data, or resume from the last checkpoint"
            if "model.aux_loss_coef" in found:  # the cause named the coefficients: that is the fix
                fix = "Lower model.aux_loss_coef / model.z_loss_coef (the router losses overflowed, not the model)"
            raise DivergenceError(
                f"training stopped at step {step}: the loss or the gradient norm is NaN/inf on rank(s) {bad_ranks} "
                f"(this rank: {detail}) for {self.streak} step(s) in a row "
                f"(train.max_nonfinite_steps={self.limit}); the bad steps updated nothing and no checkpoint of them "
                f"was saved. {fix}"
            )
        if self.verbose:
            print(
                f"step {step}: the loss or the gradient norm is NaN/inf on rank(s) {bad_ranks} ({detail} here): "
                f"update skipped ({self.streak} of at most {self.limit - 1} in a row)",
                flush=True,
            )
        return False
