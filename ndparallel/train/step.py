"""One training step, the same for ``ndparallel train``, the bench and (its precision rule) the Accelerator.

:class:`TrainStep` runs one optimizer step on this rank's slice of the global batch: split it into
micro-batches; for each, shard the sequence over ``cp``, forward (under autocast where FSDP does not
cast), cross-entropy in fp32 or wider plus any auxiliary loss (an MoE router's), divided by the micro-batch
count, backward with the gradient communication :func:`ndparallel.parallel.grad_sync.micro_batch_sync`
decides; then clip the global gradient norm, let every rank agree the loss and norm are finite
(:class:`~ndparallel.train.nonfinite.NonFiniteGuard`), and step the optimizer only if they are. After it, an
MoE model's routers report the step's global tokens per expert, and a sigmoid router's balancing bias moves
by ``router_bias_rate``. What differs by model (router statistics, the bias update, whether the forward computes
the loss) the step asks the model's family (:func:`ndparallel.parallel.protocol.family_for`).

Mixed precision follows :mod:`ndparallel.config.precision`: with FSDP its policy casts; without
FSDP the forward runs under ``torch.autocast(bf16)``. The loss is computed in fp32, or float64 for a float64
model, either way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ndparallel.config.precision import forward_autocast_dtype
from ndparallel.distributed.agree import gather_vectors
from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError
from ndparallel.parallel.clip import clip_grad_norm_
from ndparallel.parallel.context_parallel import context_parallel
from ndparallel.parallel.grad_sync import micro_batch_sync
from ndparallel.parallel.loss import auxiliary_loss, cross_entropy_loss
from ndparallel.parallel.pipeline import Pipeline
from ndparallel.parallel.protocol import family_for
from ndparallel.train.nonfinite import NonFiniteGuard

__all__ = ["StepResult", "TrainStep"]


# Router losses this many times the cross entropy (or inf) are what overflowed, when a step is not finite (float64:
# aux_loss_coef=1e300 gives a finite 1e300 loss, and the gradient norm overflows).
_ROUTER_LOSS_DOMINATES = 1e6


@dataclass
class StepResult:
    loss: torch.Tensor
    """This rank's mean loss over its micro-batches (fp32 or wider; average it over ``dp_cp`` for the global one)."""
    grad_norm: float
    """The global gradient norm before clipping."""
    applied: bool
    """False when the loss or the norm was NaN/inf on some rank: the optimizer did not step."""
    router_loads: list[torch.Tensor] = field(default_factory=list)
    """Each MoE router's tokens per expert over this step's micro-batches, of the global batch (the same on
    every rank); empty for a dense model (and for Hugging Face MoE models, whose routers keep no counts)."""


class TrainStep:
    """Forward, loss, backward over micro-batches, clipping, the non-finite guard and the optimizer step.

    ``model`` is parallelised over ``mesh`` (with :func:`ndparallel.config.precision.parallelize_config`).
    ``max_grad_norm`` 0 disables clipping (the norm is still measured). ``defer_grad_sync``: see
    :func:`ndparallel.parallel.grad_sync.micro_batch_sync`.
    ``check_finite=False`` drops the non-finite agreement, only for runs whose numbers mean nothing (the
    bench's compute-only twin). ``phase(text)`` is told what runs next, e.g. ``"step 3: forward/backward"``
    (the watchdog's heartbeat). ``around()`` is entered around each micro-batch's forward/backward and around
    the clipping and optimizer step: the bench counts collectives with it.
    ``router_bias_rate``: how far a sigmoid router's balancing bias moves after each applied step (0: it stays;
    ``train.router_bias_rate``).

    Pipeline parallel (``model`` a :class:`~ndparallel.parallel.pipeline.Pipeline`, ``optimizer`` one per stage module):
    the pipeline's micro-batches are the accumulation (fixed when it was built), clipping spans every stage.
    """

    def __init__(
        self,
        model: nn.Module | Pipeline,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        mesh: Mesh,
        *,
        max_grad_norm: float = 1.0,
        defer_grad_sync: bool = False,
        max_nonfinite_steps: int = 1,
        check_finite: bool = True,
        verbose: bool = False,
        phase: Callable[[str], None] | None = None,
        around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        router_bias_rate: float = 0.0,
    ) -> None:
        self.model, self.mesh = model, mesh
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.optimizer = self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers  # as given
        self.device = mesh.device
        self.max_grad_norm = max_grad_norm
        self.defer_grad_sync = defer_grad_sync
        self.autocast_dtype = forward_autocast_dtype(mesh.config)
        self.guard = NonFiniteGuard(max_nonfinite_steps, verbose=verbose) if check_finite else None
        self._phase = phase or (lambda name: None)
        self.around = around
        self.router_bias_rate = router_bias_rate

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def __call__(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        accumulation: int,
        step: int,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> StepResult:
        """One optimizer step on this rank's ``[batch, seq]`` tokens and labels in ``accumulation`` micro-batches.

        ``step``: the 1-based number of this step (named when the loss is not finite). ``positions`` and
        ``document_ids`` (``[batch, seq]``, packed documents: :meth:`ndparallel.train.data.BatchLoader.masks`) are
        split and sharded with the tokens and passed to the model.
        """
        self._phase(f"step {step}: forward/backward")
        if isinstance(self.model, Pipeline):
            if accumulation != self.model.microbatches:
                raise ConfigError(
                    f"accumulation={accumulation} but the pipeline was built for {self.model.microbatches} "
                    "micro-batches (pp_microbatches): under pp they are one number; build it with microbatches="
                    f"{accumulation}"
                )
            masks = {"positions": positions, "document_ids": document_ids}
            return self._pipeline_step(inputs, labels, step, {k: v for k, v in masks.items() if v is not None})
        loss_sum = torch.zeros((), device=self.device)
        fused_head = family_for(self.model).loss_in_forward(self.model)  # compile: blocks compiled the loss head
        micro_batches = list(zip(inputs.chunk(accumulation), labels.chunk(accumulation), strict=True))
        rows = [(None, None)] * accumulation
        if document_ids is not None:
            rows = list(zip(positions.chunk(accumulation), document_ids.chunk(accumulation), strict=True))
        for index, ((x, y), (p, ids)) in enumerate(zip(micro_batches, rows, strict=True)):
            x, y = x.to(self.device), y.to(self.device)
            if ids is None:
                positions_, buffers, dims, extra = torch.arange(x.shape[1], device=self.device), [x, y], [1, 1, 0], {}
            else:  # packed documents: [batch, seq] positions restarting per document, and the document ids
                positions_, ids = p.to(self.device), ids.to(self.device)
                buffers, dims, extra = [x, y, ids], [1, 1, 1, 1], {"document_ids": ids}
            last = index == len(micro_batches) - 1
            with (
                self.around(),
                micro_batch_sync(self.model, last, self.defer_grad_sync),
                context_parallel(self.mesh, buffers=[*buffers, positions_], seq_dims=dims),
            ):
                with self._autocast():
                    # compile: blocks compiled the model's projection + cross entropy as one graph: it takes labels
                    out = (
                        self.model(x, positions_, labels=y, **extra)
                        if fused_head
                        else self.model(x, positions_, **extra)
                    )
                loss = out if fused_head else cross_entropy_loss(out, y)  # fp32 or wider (float64 stays)
                aux = auxiliary_loss(self.model)  # an MoE router's balancing and z-loss, on the global micro-batch
                self._router_losses = None if aux is None else (loss.detach(), aux.detach())
                loss = (loss if aux is None else loss + aux) / len(micro_batches)
                loss.backward()
            loss_sum = loss_sum + loss.detach()  # out of place: a float64 loss is not rounded to fp32
        self._phase(f"step {step}: gradient clipping and optimizer step")
        with self.around():
            grad_norm = float(clip_grad_norm_(self.model.parameters(), self.max_grad_norm or math.inf))
            return self._apply(step, loss_sum, grad_norm)

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor, step: int, masks: dict) -> StepResult:
        with self.around():
            loss = self.model.step(inputs, labels, **masks)  # the global mean loss, every rank
        self._phase(f"step {step}: gradient clipping over the pipeline and optimizer step")
        with self.around():
            grad_norm = float(self.model.clip_grad_norm_(self.max_grad_norm or math.inf))
            return self._apply(step, loss, grad_norm)

    def _apply(self, step: int, loss: torch.Tensor, grad_norm: float) -> StepResult:
        # Raises after N bad steps in a row. Unchecked (the bench's compute-only twin, whose collectives
        # move nothing): every step applies.
        applied = self.guard.step_is_finite(step, loss, grad_norm, self._nonfinite_routers) if self.guard else True
        for optimizer in self.optimizers:
            if applied:  # a NaN/inf never reaches the weights
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loads = self._end_routing(applied)
        return StepResult(loss, grad_norm, applied, loads)

    def _nonfinite_routers(self) -> str:
        """Which MoE routers' logits held a NaN/inf in this step's forwards on this rank (the first sign of a
        diverging MoE), for the non-finite guard's message; empty if none did."""
        modules = self.model.stages if isinstance(self.model, Pipeline) else [self.model]
        names = [name for module in modules for name in family_for(module).nonfinite_routers(module)]
        if names:
            return f"NaN/inf router logits in {', '.join(names)}"
        return self._overflowing_router_losses()

    def _overflowing_router_losses(self) -> str:
        """When the cross entropy was finite but the routers' losses were not (logits fine): their coefficients
        (``model.aux_loss_coef=1e300`` overflowed; the advice used to be about the lr and the data)."""
        ce, aux = getattr(self, "_router_losses", None) or (None, None)
        if ce is None or not bool(torch.isfinite(ce).all()):
            return ""
        ce_value, aux_value = float(ce.sum()), float(aux.sum())
        if math.isfinite(aux_value) and abs(aux_value) < _ROUTER_LOSS_DOMINATES * max(1.0, abs(ce_value)):
            return ""  # finite and not a million times the cross entropy: not what overflowed
        owners = (m for m in self.model.modules() if hasattr(m, "z_loss_coef"))
        coefs = next(((m.aux_loss_coef, m.z_loss_coef) for m in owners), None)
        said = f" (model.aux_loss_coef={coefs[0]:g}, model.z_loss_coef={coefs[1]:g})" if coefs else ""
        return (
            f"the router losses are {aux_value:.4g} while the cross entropy is {ce_value:.4g}: their "
            f"coefficients{said} overflow"
        )

    def _end_routing(self, applied: bool) -> list[torch.Tensor]:
        """The routers' global tokens per expert of this step (under pp every stage's, in stage order, on every
        rank); then move the balancing biases (an applied step only) and reset the counts for the next."""
        pipeline = isinstance(self.model, Pipeline)
        modules = self.model.stages if pipeline else [self.model]
        loads = [family_for(module).router_loads(module) for module in modules]
        for module in modules:
            family_for(module).update_router_biases(module, self.router_bias_rate if applied else 0.0)
        if not pipeline or self.model.aux_losses is None:
            return [load for per_module in loads for load in per_module]
        layout, counts = _encode_stage_loads(zip(self.model.stage_ids, loads, strict=True))
        group = self.model.pp_group
        every = zip(gather_vectors(layout, group=group), gather_vectors(counts, group=group), strict=True)
        stages = sorted((stage for vectors in every for stage in _decode_stage_loads(*vectors)), key=lambda s: s[0])
        return [load for _, per in stages for load in per]


def _encode_stage_loads(stages: Iterable[tuple[int, Sequence[torch.Tensor]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(stage id, [tokens per expert of each router])]`` as two vectors for tensor all-gathers: the layout
    (int64; per stage ``[id, routers, experts of each router...]``) and the counts (float64, concatenated). The
    layout is a control tensor of its own: the dry run keeps it real while the counts stay fake
    (``ndparallel/dryrun/values.py``)."""
    layout: list[int] = []
    counts: list[torch.Tensor] = []
    for stage_id, per_router in stages:
        layout += [stage_id, len(per_router), *(load.numel() for load in per_router)]
        counts += [load.detach().cpu().double().reshape(-1) for load in per_router]
    return torch.tensor(layout, dtype=torch.int64), torch.cat(counts) if counts else torch.zeros(0, dtype=torch.float64)


def _decode_stage_loads(layout: torch.Tensor, counts: torch.Tensor) -> list[tuple[int, list[torch.Tensor]]]:
    """The inverse of :func:`_encode_stage_loads`."""
    values, at, offset, stages = layout.tolist(), 0, 0, []
    while at < len(values):
        stage_id, routers = values[at], values[at + 1]
        sizes, at = values[at + 2 : at + 2 + routers], at + 2 + routers
        per_router = []
        for n in sizes:
            per_router.append(counts[offset : offset + n].clone())
            offset += n
        stages.append((stage_id, per_router))
    return stages
