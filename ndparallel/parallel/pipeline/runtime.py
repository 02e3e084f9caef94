"""``Pipeline``: this rank's stages and torch's schedule; one ``step`` = every micro-batch forward and backward.

What the step makes right across stages (docs/pipeline-parallel.md):

* the loss: the mean of the last stage's micro-batch losses (equal micro-batches: the mean over the rank's
  batch), averaged over ``dp_cp``, broadcast over pp from the rank holding the last stage; plus, for a model with
  auxiliary losses (MoE routers), every stage's, summed over pp (:mod:`ndparallel.parallel.pipeline.aux_loss`);
* context parallel: tokens, labels and ``[batch, seq]`` positions are sharded alike on every stage;
* masks (padding, packed documents): the rows' :class:`~ndparallel.distributed.documents.DocumentMask` travels
  with the micro-batches to every stage as one ``[batch, 2, seq]`` tensor of query and key document ids over the
  whole (unsharded) rows (docs/pipeline-parallel.md#masks);
* pure replicate: the schedule runs under ``no_sync`` and gradients are averaged over ``dp_replicate`` once
  after it (FSDP needs nothing: torch's stage drives FSDP's gradient sync itself);
* weights tied across stages (an embedding and its head): every copy gets the summed gradient, and the
  clipping norm counts one copy (:mod:`ndparallel.parallel.pipeline.tied`);
* shapes: torch fixes them at the first step, and a later change hangs: it is refused instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.config.pipeline import schedule_spec
from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError
from ndparallel.parallel.clip import clip_grad_norm_
from ndparallel.parallel.context_parallel import context_parallel
from ndparallel.parallel.masks import document_ids_mask, hf_document_mask, mask_shape_problem
from ndparallel.parallel.pipeline.aux_loss import AuxLossRecord
from ndparallel.parallel.pipeline.tied import TiedCopies, sum_tied_grads
from ndparallel.parallel.replicate import no_sync

T = TypeVar("T")

__all__ = ["Pipeline"]


class Pipeline:
    """This rank's share of a pipeline-parallel model (built by :func:`ndparallel.parallel.pipeline.build_pipeline`).

    ``stages``: the stage modules (parallelised, materialised); ``stage_ids``: their indices; ``step(tokens,
    labels)``: forward and backward of this rank's ``[batch, seq]`` slice in ``microbatches`` micro-batches,
    returning the global mean loss (the same value on every rank); gradients are left in the stages.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        stage_ids: Sequence[int],
        schedule,
        mesh: Mesh,
        microbatches: int,
        last_stage_rank: int,
        positions_arg: str,
        tied: TiedCopies | None = None,
        schedule_name: str = "",
        aux_losses: AuxLossRecord | None = None,
    ) -> None:
        self.stages = list(stages)
        self.stage_ids = list(stage_ids)
        self.schedule = schedule
        self.schedule_name = schedule_name
        self.mesh = mesh
        self.microbatches = microbatches
        self.last_stage_rank = last_stage_rank
        self.positions_arg = positions_arg
        self.tied = tied or TiedCopies()
        self.aux_losses = aux_losses  # None: the model has no auxiliary losses (every rank knows alike)
        self.absorbs_shape_inference = True
        """A model with auxiliary losses runs its first batch (and its first after a switch between step and eval)
        once before the real run, to keep torch's shape inference out of its router counts and losses
        (:meth:`_dry_run`). ``ndparallel dry-run``, which measures a step of a job under way and whose values are
        fake, turns it off: that run doubles a first step's time and is no part of a later step."""
        self.pp_group = mesh["pp"].get_group()
        inner = mesh.without_pp()
        self._inner = inner
        self._replicate = inner.size("dp_replicate") > 1 and inner.fsdp is None
        self._holds_last = mesh.local_rank("pp") == last_stage_rank
        self._shape: tuple | None = None
        self._masked: bool | None = None  # whether the batches carry a mask (fixed at the first step, as shapes)
        self._last_mode: bool | None = None  # training (step) or not (eval) on the last run; None before any

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's stages (once, should two stages share one)."""
        return _once(param for stage in self.stages for param in stage.parameters())

    def modules(self) -> Iterator[nn.Module]:
        """Every module of this rank's stages (once), what a walk of the model such as
        ``update_router_biases(model, rate)`` needs to reach every stage's routers."""
        return _once(module for stage in self.stages for module in stage.modules())

    def check_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Refuse (ConfigError, this rank only) a batch the schedule cannot run: not ``[batch, seq]``, a batch the
        micro-batches do not divide, or a shape other than the first step's (torch would hang)."""
        if tokens.dim() != 2 or tokens.shape != labels.shape:
            raise ConfigError(
                f"pipeline step needs [batch, seq] tokens and labels of one shape, got {list(tokens.shape)} and "
                f"{list(labels.shape)}"
            )
        batch, m = tokens.shape[0], self.microbatches
        if batch % m:
            raise ConfigError(
                f"pp_microbatches={m} does not divide this rank's batch of {batch} sequences (global batch / dp): "
                f"torch's pipeline needs equal micro-batches; use a batch that is a multiple of {m}"
            )
        shape = (tuple(tokens.shape), tokens.dtype, labels.dtype)
        if self._shape is not None and shape != self._shape:
            raise ConfigError(
                f"pipeline batch shape changed from {list(self._shape[0])} to {list(tokens.shape)}: torch's schedule "
                "fixes shapes at the first step and would hang on another; keep the batch and sequence length fixed"
            )
        self._shape = shape

    def _sync_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self._replicate:
            for stage in self.stages:
                stack.enter_context(no_sync(stage))
        return stack

    def _average_replicas(self) -> None:
        """Pure replicate: one all-reduce of every gradient over ``dp_replicate`` (they accumulated locally)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if not local:
            return
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=self._inner["dp_replicate"].get_group())
        flat /= self._inner.size("dp_replicate")
        offset = 0
        for g in local:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        device = self.mesh.device
        if self._holds_last:
            local = torch.stack([loss.detach().to(torch.float64) for loss in losses]).mean().reshape(1).to(device)
            if self._inner.size("dp_cp") > 1:
                dist.all_reduce(local, group=self._inner["dp_cp"].get_group())
                local /= self._inner.size("dp_cp")
        else:
            local = torch.zeros(1, dtype=torch.float64, device=device)
        dist.broadcast(local, group=self.pp_group, group_src=self.last_stage_rank)
        if self.aux_losses is not None:
            local = local + self._global_aux_loss()
        return local[0]

    def _global_aux_loss(self) -> torch.Tensor:
        """This step's aux losses: the mean over micro-batches of every stage's, averaged over ``dp_cp``."""
        values = self.aux_losses.take()
        aux = (
            torch.stack([v.to(torch.float64) for v in values]).sum() if values else torch.zeros((), dtype=torch.float64)
        )
        aux = (aux / self.microbatches).reshape(1).to(self.mesh.device)
        dist.all_reduce(aux, group=self.pp_group)
        if self._inner.size("dp_cp") > 1:
            dist.all_reduce(aux, group=self._inner["dp_cp"].get_group())
            aux /= self._inner.size("dp_cp")
        return aux

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, **masks: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the global mean loss (float64, every rank).

        ``masks`` (each ``[batch, seq]`` like the tokens, optional): ``positions`` (rotary positions; for a Hugging
        Face model also its packed documents, as transformers reads restarting ``position_ids``),
        ``attention_mask`` (0/1 padding, a key mask) and ``document_ids`` (the reference model's documents;
        negative ids pad). They reduce to one mask (:mod:`ndparallel.parallel.masks`) split with the micro-batches.
        """
        return self._run(tokens, labels, self.schedule.step, training=True, masks=masks)

    def eval(self, tokens: torch.Tensor, labels: torch.Tensor, **masks: torch.Tensor | None) -> torch.Tensor:
        """Forward only (torch's ``schedule.eval``, no gradients): the global mean loss, as :meth:`step`'s."""
        if not hasattr(self.schedule, "eval"):
            raise ConfigError(f"pipeline eval needs torch's schedule.eval, which torch {torch.__version__} lacks")
        if self.schedule_name and schedule_spec(self.schedule_name).style == "v":
            # torch's V schedules keep their backward actions in eval and fail mid-schedule (or hang): refuse first
            raise ConfigError(
                f"pipeline eval under pp_schedule={self.schedule_name!r} fails inside torch's V schedules (their "
                "eval still runs backward actions); evaluate a model trained with pp_schedule='interleaved_1f1b' "
                "or '1f1b', or evaluate the saved weights in one process"
            )
        # torch's eval divides every gradient by the micro-batch count (and its shape inference sets FSDP's to
        # None): an eval between a step's backward and the optimizer step must leave them as they were
        params, grads = self._gradients()
        try:
            with torch.no_grad():
                return self._run(tokens, labels, self.schedule.eval, training=False, masks=masks)
        finally:
            self._restore_gradients(params, grads)

    def _run(self, tokens: torch.Tensor, labels: torch.Tensor, run, training: bool, masks: dict) -> torch.Tensor:
        self.check_batch(tokens, labels)
        positions, documents = self._masks(tokens, masks)
        if self._masked is not None and self._masked != (documents is not None):
            raise ConfigError(
                "pipeline batches switched between masked (padding / documents) and unmasked: torch's schedule fixes "
                "its inputs at the first step and would hang on others; pass a mask with every batch, or with none"
            )
        self._masked = documents is not None
        if self.aux_losses is not None and self.absorbs_shape_inference and training != self._last_mode:
            # torch infers shapes again: absorb it
            self._dry_run(tokens, labels, run, positions, documents)
        self._last_mode = training
        losses = self._schedule(tokens, labels, run, positions, documents)
        if self._replicate and torch.is_grad_enabled():
            self._average_replicas()
        if torch.is_grad_enabled():
            sum_tied_grads(self.tied, self.pp_group)
        return self._global_loss(losses)

    def _masks(self, tokens: torch.Tensor, masks: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(positions, the ``[batch, 2, seq]`` document ids) of this batch, from :meth:`step`'s ``masks``."""
        unknown = sorted(set(masks) - {"positions", "attention_mask", "document_ids"})
        if unknown:
            raise ConfigError(f"pipeline step got {unknown}: it takes positions, attention_mask and document_ids")
        batch, seq = tokens.shape
        masks = {name: value for name, value in masks.items() if value is not None}
        for name, value in masks.items():
            problem = mask_shape_problem(name, value, batch, (seq,))
            if problem:
                raise ConfigError(problem)
        positions, ids, padding = masks.get("positions"), masks.get("document_ids"), masks.get("attention_mask")
        if ids is not None:
            if padding is not None:
                raise ConfigError("pipeline step got document_ids and attention_mask: give negative ids to padding")
            documents = document_ids_mask(ids, batch, seq)
        elif self.positions_arg == "position_ids":  # a Hugging Face model: transformers' own reading
            documents = hf_document_mask(batch, seq, padding, positions)
        else:
            documents = None if padding is None or bool(padding.all()) else hf_document_mask(batch, seq, padding)
        if documents is None:
            return positions, None
        return positions, torch.stack((documents.query_docs, documents.key_docs), dim=1)

    def _schedule(
        self, tokens: torch.Tensor, labels: torch.Tensor, run, positions=None, documents=None
    ) -> list[torch.Tensor]:
        """torch's schedule over this batch (``run``: its step or eval); the last stage's micro-batch losses."""
        device = self.mesh.device
        x, y = tokens.to(device).clone(), labels.to(device).clone()
        batch, seq = x.shape
        if positions is None:
            positions = torch.arange(seq, device=device)
        positions = positions.to(device).expand(batch, seq).contiguous()  # micro-batched like x
        losses: list[torch.Tensor] = []
        with context_parallel(self._inner, [x, y, positions], seq_dims=[1, 1, 1]), self._sync_context():
            args = (x,) if 0 in self.stage_ids else ()
            kwargs = {self.positions_arg: positions}
            if documents is not None:  # the whole rows (not sharded): every cp rank's attention needs them all
                kwargs["documents"] = documents.to(device)
            run(*args, target=y, losses=losses, return_outputs=False, **kwargs)
        return losses

    def _dry_run(self, tokens: torch.Tensor, labels: torch.Tensor, run, positions=None, documents=None) -> None:
        """Before a model with auxiliary losses runs its first batch, and whenever it switches between step and
        eval: torch then infers the stages' shapes with stage forwards of its own (on tensors it makes up), which
        would add to the routers' counts and the aux losses. Run the schedule once, then put every buffer and
        gradient back as they were and drop its losses."""
        saved = [{name: b.detach().clone() for name, b in stage.named_buffers()} for stage in self.stages]
        params, grads = self._gradients()
        cuda = [self.mesh.device.index or 0] if self.mesh.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # as torch's own inference: the real run draws what it would
            self._schedule(tokens, labels, run, positions, documents)
        with torch.no_grad():
            for stage, buffers in zip(self.stages, saved, strict=True):
                for name, buffer in stage.named_buffers():
                    buffer.copy_(buffers[name])
        self._restore_gradients(params, grads)
        self.aux_losses.take()

    def _gradients(self) -> tuple[list[nn.Parameter], list[torch.Tensor | None]]:
        params = list(self.parameters())
        return params, [None if p.grad is None else p.grad.detach().clone() for p in params]

    @staticmethod
    def _restore_gradients(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every stage's gradients by the global norm over all stages; returns the norm before clipping."""
        return clip_grad_norm_(list(self.parameters()), max_norm, pp_group=self.pp_group)

    def zero_grad(self) -> None:
        for stage in self.stages:
            stage.zero_grad(set_to_none=True)


def _once(items: Iterable[T]) -> Iterator[T]:
    """``items`` without repeats (by identity): stages may share a module or parameter (tied weights)."""
    seen: set[int] = set()
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            yield item
