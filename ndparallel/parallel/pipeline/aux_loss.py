"""Auxiliary losses under pp: an MoE router's balancing and z-loss on every stage, in the backward and the loss.

A stage's routers leave their loss in ``aux_loss`` (:func:`ndparallel.parallel.loss.auxiliary_loss` collects it),
but torch's schedule backpropagates only the last stage's ``loss_fn``: the aux loss of an earlier stage would
never reach the gradients, and the reported loss would lack it. :func:`attach_auxiliary_losses` hooks every stage
module: after each micro-batch's forward its aux loss rides on the stage output through :class:`_WithAuxGrad`,
an identity whose backward also hands the aux loss a gradient of 1, exactly what ``(loss_fn + aux)`` of that
micro-batch would give it (torch then divides every gradient by the micro-batch count, as for the cross entropy).
Its detached value is recorded for :class:`ndparallel.parallel.pipeline.Pipeline`'s reported loss.
"""

from __future__ import annotations

import torch
from torch import nn

from ndparallel.parallel.loss import auxiliary_loss

__all__ = ["AuxLossRecord", "attach_auxiliary_losses"]


class _WithAuxGrad(torch.autograd.Function):
    """``out`` unchanged (its storage, not an autograd view of it: torch's stages detach their outputs in place);
    backward passes ``out``'s gradient on and gives ``aux`` a gradient of 1."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class AuxLossRecord:
    """The detached aux losses of this rank's stage forwards since the last :meth:`take`, and the hooks'
    handles (``remove()`` detaches them)."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def take(self) -> list[torch.Tensor]:
        values, self.values = self.values, []
        return values


def attach_auxiliary_losses(module: nn.Module, record: AuxLossRecord) -> None:
    """Hook ``module`` (a stage) so that each forward's aux loss reaches the backward through its output."""

    def hook(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        aux = auxiliary_loss(module)
        if aux is None:
            return output
        record.values.append(aux.detach())
        if not torch.is_grad_enabled() or not aux.requires_grad:
            return output
        return _WithAuxGrad.apply(output, aux)

    record.handles.append(module.register_forward_hook(hook))
