"""The model ``prepare()`` returns under pipeline parallelism (``pp_size > 1``): one call = one pipeline step.

As in 🤗 Accelerate's Megatron-LM integration, the model call runs the forward **and** backward of every
micro-batch (torch's schedule owns both) and returns an output whose ``loss`` is the global mean loss;
``accelerator.backward(outputs.loss)`` then does nothing. Gradients are left in this rank's stage modules,
where the prepared optimizer (re-pointed at them) steps. Under ``model.eval()`` or ``torch.no_grad()`` the
call runs the forward only (torch's ``schedule.eval``) and returns the same loss. Logits stay on the last
stage's ranks and are never returned (``outputs.logits`` is None). docs/accelerate-migration.md has the loop.

The loss is exact, also with ``-100`` labels spread unevenly over micro-batches and data-parallel ranks: each
micro-batch's loss is its token sum times ``micro-batches x dp_cp / (valid tokens of the global batch)``, so
torch's mean over micro-batches and the mean over ``dp_cp`` give the one-process mean over valid tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.agree import agree, gather_text
from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError
from ndparallel.parallel.loss import token_loss_sum
from ndparallel.parallel.masks import hf_document_mask
from ndparallel.parallel.pipeline import Pipeline, build_pipeline
from ndparallel.parallel.pipeline.tied import one_process_parameters

__all__ = ["IGNORE_INDEX", "PipelineModel", "PipelineOutput", "loss_kind", "prepare_pipeline"]

IGNORE_INDEX = -100
_MARK = "_ndp_pipeline_loss"  # on a returned loss: "backward" (gradients are in the stages) or "eval"


class _ScaledTokenSum:
    """The schedule's loss: a micro-batch's token cross-entropy sum times ``scale`` (set before each step)."""

    scale = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(output, target, IGNORE_INDEX) * self.scale


@dataclass
class PipelineOutput:
    """What a pipeline model call returns: ``loss`` (the global mean, float64, the same on every rank).
    ``logits`` is always None: they exist only on the last stage's ranks."""

    loss: torch.Tensor
    logits: None = None

    def __getitem__(self, key: str | int) -> Any:
        return getattr(self, key) if isinstance(key, str) else (self.loss,)[key]


def loss_kind(loss: Any) -> str | None:
    """``"backward"``: a loss whose pipeline step already ran backward; ``"eval"``: a forward-only one; else None."""
    return getattr(loss, _MARK, None)


def _targets(input_ids: Any, labels: Any, shift_labels: Any, extra: dict) -> torch.Tensor:
    """Next-token targets ``[batch, seq]`` (``-100``: ignored) from ``labels`` (shifted here, Hugging Face's
    convention) or ``shift_labels`` (used as given); anything the pipeline cannot honour is refused."""
    given = sorted(k for k, v in extra.items() if v is not None)
    if given:
        raise ConfigError(
            f"model({', '.join(given)}=...) is not supported under pp_size > 1: the call takes input_ids, "
            "labels= or shift_labels=, and attention_mask= / position_ids= (padding, packed documents) only"
        )
    if not isinstance(input_ids, torch.Tensor):
        raise ConfigError(
            "under pp_size > 1 call model(input_ids, labels=...): input_ids must be a [batch, seq] tensor"
        )
    if (labels is None) == (shift_labels is None):
        raise ConfigError(
            "under pp_size > 1 the model call runs the whole pipeline step and returns outputs.loss (no logits): "
            "pass exactly one of labels= (Hugging Face's convention, shifted inside) or shift_labels= (the next "
            "token of each position)"
        )
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


class PipelineModel:
    """This rank's pipeline stages behind a model call (what ``prepare()`` returns when ``pp_size > 1``).

    ``model(input_ids, labels=...)`` or ``model(input_ids, shift_labels=...)`` returns a
    :class:`PipelineOutput`; in training mode with gradients enabled it has run backward too.
    ``parameters()`` / ``named_parameters()`` are this rank's (unsplit model names); ``stages`` and
    ``pipeline`` give the modules and the :class:`ndparallel.parallel.pipeline.Pipeline`.
    """

    def __init__(self, pipeline: Pipeline, loss: _ScaledTokenSum, config: Any = None):
        self.pipeline = pipeline
        self.stages: list[nn.Module] = pipeline.stages
        self.config = config
        self.training = True
        self._loss = loss
        mesh = pipeline.mesh
        self._dp_group = mesh["dp"].get_group() if mesh.size("dp") > 1 else None
        self._dp_cp = mesh.without_pp().size("dp_cp")

    def train(self, mode: bool = True) -> PipelineModel:
        self.training = mode
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> PipelineModel:
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        yield from self.pipeline.parameters()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for stage in self.stages:
            yield from stage.named_parameters(*args, **kwargs)

    def modules(self) -> Iterator[nn.Module]:
        yield from self.pipeline.modules()

    def one_process_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their one-process names: a tied weight's copy (the last stage's
        ``lm_head``) under the weight's name, as the one-process model lists the one tensor."""
        return [item for stage in self.stages for item in one_process_parameters(stage)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stage in self.stages:
            stage.zero_grad(set_to_none=set_to_none)

    def __call__(self, *args: Any, **kwargs: Any) -> PipelineOutput:
        return self.forward(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **extra: Any,
    ) -> PipelineOutput:
        """One pipeline step over this rank's ``[batch, seq]`` batch (see the class doc). ``num_items_in_batch``:
        the valid tokens the loss is divided by (transformers' meaning: those of the global batch, over every
        data rank and accumulation step), instead of this call's."""
        error, targets = None, None
        try:  # a refusal on one rank (its batch) is raised on every rank before the pipeline's collectives
            targets = _targets(input_ids, labels, shift_labels, extra)
            self.pipeline.check_batch(input_ids, targets)
            hf_document_mask(*input_ids.shape, attention_mask, position_ids)  # refused here, on every rank alike
        except ConfigError as err:
            error = err
        agree(error, "", error_type=ConfigError)
        count = (targets != IGNORE_INDEX).sum().reshape(1).to(self.pipeline.mesh.device, torch.int64)
        if num_items_in_batch is not None:
            count = torch.as_tensor(num_items_in_batch, dtype=torch.float64).reshape(1).round().to(count)
        elif self._dp_group is not None:
            dist.all_reduce(count, group=self._dp_group)  # pp/tp/cp ranks of one dp index hold the same batch
        if int(count.item()) == 0:
            raise ConfigError("every label of this global batch is -100 (ignored): there is no loss to compute")
        self._loss.scale = self.pipeline.microbatches * self._dp_cp / float(count.item())
        backward = self.training and torch.is_grad_enabled()
        run = self.pipeline.step if backward else self.pipeline.eval
        loss = run(input_ids, targets, attention_mask=attention_mask, positions=position_ids)  # masks: the pipeline's
        setattr(loss, _MARK, "backward" if backward else "eval")
        return PipelineOutput(loss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's full (gathered) CPU tensors on rank 0 under the unsplit names, ``{}`` elsewhere.
        Collective: every rank calls it. Nothing is pickled: the names, shapes and dtypes travel as text
        (:func:`ndparallel.distributed.agree.gather_text`), the tensors by point-to-point sends to rank 0."""
        pp_group = self.pipeline.pp_group
        sends = 0 in dist.get_process_group_ranks(pp_group)  # this slice's first rank: rank 0's pp group
        local: list[tuple[int, str, torch.Tensor]] = []
        for sid, stage in zip(self.pipeline.stage_ids, self.stages, strict=True):
            for name, tensor in stage.state_dict().items():
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective over the slice
                if sends:  # other slices only join the gather above
                    local.append((sid, name, full.detach()))
        if not sends:
            return {}
        layout = json.dumps([[sid, name, list(t.shape), str(t.dtype).removeprefix("torch.")] for sid, name, t in local])
        layouts = [json.loads(text) for text in gather_text(layout, group=pp_group)]
        if dist.get_rank(pp_group) != 0:
            for _, _, tensor in local:
                dist.send(tensor.contiguous(), group=pp_group, group_dst=0)
            return {}
        received = [(sid, name, tensor.to("cpu", copy=True)) for sid, name, tensor in local]
        device = self.pipeline.mesh.device
        for source, entries in enumerate(layouts[1:], start=1):
            for sid, name, shape, dtype in entries:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.recv(tensor, group=pp_group, group_src=source)
                received.append((sid, name, tensor.cpu()))
        return {name: tensor for _, name, tensor in sorted(received, key=lambda entry: entry[0])}


def prepare_pipeline(model: nn.Module, cfg: ParallelismConfig, mesh: Mesh) -> PipelineModel:
    """``model`` (the reference Transformer, possibly on the meta device, or a Hugging Face causal LM with its
    weights) cut into this rank's stages by :func:`ndparallel.parallel.pipeline.build_pipeline`."""
    loss = _ScaledTokenSum()
    pipeline = build_pipeline(model, cfg, mesh, loss_fn=loss)
    return PipelineModel(pipeline, loss, getattr(model, "config", None))
