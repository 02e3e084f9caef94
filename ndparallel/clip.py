"""Gradient-norm clipping that is correct whatever mix of meshes and tensor kinds the parameters have.

``torch.nn.utils.clip_grad_norm_`` needs every gradient on one mesh and of one kind: after TP
and FSDP a model may hold DTensors on a 2-D (dp, tp) mesh, DTensors on a 1-D mesh and plain
tensors. Here gradients are grouped by mesh, each group's norm is computed with the DTensor
reduction its placements imply (Shard: sum over the mesh; Replicate: local; Partial: reduced),
the group norms are combined into the true global norm, and every group is scaled by one
coefficient.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _grads_by_mesh(parameters: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key = grad.device_mesh if isinstance(grad, DTensor) else ("local", grad.device)
        groups.setdefault(key, []).append(grad)
    return groups


@contextlib.contextmanager
def _quiet_sequential_reduce_warning() -> Iterator[None]:
    # Reducing a scalar norm that is Partial over a 2-D/3-D mesh makes DTensor log, on every rank
    # and every step, that it runs one all-reduce per mesh dim. For one scalar that costs nothing
    # measurable, and the message would flood the training output.
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def total_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """The norm of all gradients together, as one process holding the full model would compute it."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    norms = []
    device = None
    for grads in _grads_by_mesh(parameters).values():
        with _quiet_sequential_reduce_warning():
            norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()  # reduces Partial placements over the mesh
        norms.append(norm.float())
        device = device or norm.device
    if not norms:
        return torch.tensor(0.0)
    return _combine([n.to(device) for n in norms], norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before clipping.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` (``norm_type`` may be ``inf``), but
    parameters may live on different device meshes and mix DTensors with plain tensors. The
    returned norm is a plain tensor, equal on every rank to the single-process norm.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0 (a negative value would flip the gradients' sign)")
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, foreach=foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite; "
            "set error_if_nonfinite=False to clip anyway"
        )
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # same formula as torch.nn.utils
    for grads in _grads_by_mesh(parameters).values():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.device, local.dtype))
    return total
