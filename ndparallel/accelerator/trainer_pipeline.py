"""The Trainer under pipeline parallelism (``pp_size > 1``): each of its micro-batches is one pipeline step.

The Trainer's loop runs one ``compute_loss`` and one ``backward`` per micro-batch (``gradient_accumulation_steps``
of them per optimizer step). Under pp the prepared model is a
:class:`~ndparallel.accelerator.pipeline.PipelineModel`, whose call runs torch's schedule, forward and backward of
every pipeline micro-batch (``pp_microbatches`` of them per Trainer micro-batch), so:

* the loss of a Trainer micro-batch is its token sum over the global batch's ``num_items_in_batch`` (every data
  rank and accumulation step, transformers' count): the same value on every rank, which the Trainer logs as it
  is, and ``backward`` is a no-op (``TrainerAccelerator.backward``);
* gradients accumulate over the Trainer's micro-batches: torch's schedule divides the stages' gradients by its
  micro-batch count at the end of each step, so each step starts from none and adds what the previous ones left;
* padded rows (``attention_mask``) and packed documents (``position_ids`` restarting; flash-attention's
  ``cu_seq_lens`` are checked against them) travel with the pipeline's micro-batches as one mask; torch's
  schedule fixes shapes at its first step, so rows need one length (``pad_to_multiple_of=max_length``);
* evaluation runs the schedule forward only: ``eval_loss`` is the token mean of each eval step's global batch
  (dp x ``per_device_eval_batch_size`` rows), one process's with that eval batch;
* refused by name (no logits leave the last stage): ``compute_metrics``, ``predict()``,
  ``load_best_model_at_end``; an eval batch of another size than the train micro-batch (torch fixes shapes);
  a loss the Trainer or a subclass computes from the logits (:mod:`ndparallel.accelerator.trainer_checks`).

docs/fine-tuning.md#the-trainer-under-pp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ndparallel.accelerator.pipeline import PipelineModel
from ndparallel.errors import ConfigError
from ndparallel.parallel.masks import FLASH_VARLEN_KWARGS, hf_document_mask

__all__ = ["is_pipeline", "pipeline_loss", "refuse_pipeline_features"]


def is_pipeline(model: Any) -> bool:
    return isinstance(model, PipelineModel)


def _take_gradients(model: PipelineModel) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Every stage parameter's gradient, detached from it (the parameter's ``grad`` is left None)."""
    taken = []
    for param in model.parameters():
        if param.grad is not None:
            taken.append((param, param.grad))
            param.grad = None
    return taken


def _add_gradients(taken: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    with torch.no_grad():
        for param, grad in taken:
            param.grad = grad if param.grad is None else param.grad + grad


def _without_varlen_keywords(inputs: dict[str, Any]) -> dict[str, Any]:
    """Flash-attention's varlen keywords (TRL's padding-free batches) checked against ``position_ids``, which
    define the documents in one process's SDPA / eager attention, then left out: the pipeline takes those."""
    varlen = {name: inputs.pop(name) for name in FLASH_VARLEN_KWARGS if name in inputs}
    cu_seq_lens = {name: value for name, value in varlen.items() if name.startswith("cu_seq_lens")}
    if cu_seq_lens and isinstance(inputs.get("input_ids"), torch.Tensor):
        batch, seq = inputs["input_ids"].shape
        hf_document_mask(batch, seq, inputs.get("attention_mask"), inputs.get("position_ids"), cu_seq_lens)
    return inputs


def pipeline_loss(model: PipelineModel, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
    """One Trainer micro-batch through the pipeline: training runs forward and backward (gradients added to
    what earlier micro-batches of the step left), evaluation the forward only. Returns the loss (module doc).

    transformers counts ``num_items_in_batch`` over the world and divides by tp x cp; the pp ranks of a data
    rank hold its batch too, so the global batch's count is that divided by pp as well."""
    inputs = _without_varlen_keywords(dict(inputs))
    if not (model.training and torch.is_grad_enabled()):
        return model(**inputs).loss
    if num_items_in_batch is None:
        raise ConfigError(
            "under pp_size > 1 the Trainer must count the global batch's tokens (num_items_in_batch): give the "
            "model's forward **kwargs (transformers' causal LMs have them) and keep average_tokens_across_devices"
        )
    taken = _take_gradients(model)
    try:
        count = num_items_in_batch / model.pipeline.mesh.size("pp")
        return model(**inputs, num_items_in_batch=count).loss
    finally:
        _add_gradients(taken)


def refuse_pipeline_features(trainer: Any) -> None:
    """What the Trainer cannot do when no logits leave the last stage, refused at ``Trainer(...)``."""
    args = trainer.args
    pp = trainer.accelerator.parallelism_config.pp_size
    if getattr(trainer, "compute_metrics", None) is not None:
        raise ConfigError(
            f"compute_metrics under pp_size={pp}: the logits stay on the last stage inside torch's schedule; "
            "evaluate the loss only (compute_metrics=None), or compute metrics with pp_size=1"
        )
    strategy = getattr(args, "eval_strategy", "no")
    evaluates = getattr(strategy, "value", strategy) != "no"  # transformers' IntervalStrategy, or its string
    train, test = args.per_device_train_batch_size, args.per_device_eval_batch_size
    if evaluates and train != test:
        raise ConfigError(
            f"per_device_eval_batch_size={test} under pp_size={pp} differs from per_device_train_batch_size={train}: "
            "torch's schedule fixes the batch shape at its first step and would hang on another; make them equal"
        )
    if getattr(args, "load_best_model_at_end", False):
        raise ConfigError(
            f"load_best_model_at_end under pp_size={pp} is not supported: save checkpoints and load the best one "
            "with ndparallel.hf.load_pretrained, or train with pp_size=1"
        )
