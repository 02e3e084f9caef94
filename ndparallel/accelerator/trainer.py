"""The 🤗 transformers ``Trainer`` (and trainers built on it, e.g. TRL's) with ndparallel's engine underneath.

``trainer_class(transformers.Trainer)`` is the Trainer with one thing changed: the accelerator it builds in
``create_accelerator_and_postprocess`` is ndparallel's :class:`~ndparallel.accelerator.core.Accelerator` (behind
:class:`TrainerAccelerator`, which adds the Accelerate attributes the Trainer reads), made from the
``parallelism_config=`` the Trainer is given. Everything else (the loop, logging, callbacks, schedulers) is the
Trainer's own. What the engine changes, the mixin says here:

* **the loss**: each rank's ``sum / num_items_in_batch`` (the global batch's token count), as transformers
  computes it; the Trainer multiplies it by the ``dp x cp`` ranks holding different tokens, and FSDP averages
  the gradients over them: one process's gradient. Under cp ndparallel's HF loss runs in that convention
  (``scaled_by_caller``, ``ndparallel/parallel/loss.py``), and TRL's fused LM head computes it the same way
  (``trl_adapter.py``); per-rank metric sums are gathered over ``dp_cp``;
* **clipping**: ndparallel's exact global norm (the Trainer's own skips what it calls mixed meshes);
* **saving**: ``save_model`` gathers full tensors on every rank (collective) and rank 0 writes transformers'
  ``model.safetensors`` + ``config.json``; the optimizer is a DCP checkpoint in ``checkpoint-N/ndp_state``
  (any mesh reads it back); the scheduler is the Trainer's ``scheduler.pt``. ``resume_from_checkpoint``
  loads the full weights before ``prepare`` (the Trainer's own path) and the optimizer after it;
* **evaluation**: under cp each rank's eval loss is its share of the batch's (as in training), so it is averaged
  over the cp group; the predictions of a cp rank are a sequence shard, so under cp only the loss is computed
  (``compute_metrics`` and ``predict()`` are refused); under tp the vocabulary-sharded logits are gathered.
  ``predict()`` returns its rows in the dataset's order (the dp sampler interleaves them). A dataset whose
  size dp does not divide is refused: the sampler would drop its last samples;
* **load_best_model_at_end**: the best checkpoint's weights come from its ``ndp_state`` (any mesh);
* **refused by name** (``trainer_checks.py``, at ``Trainer(...)``): what would train something else than one
  process or that this engine does not run (DeepSpeed, the Trainer's FSDP arguments, Accelerate's
  ``parallelism_config`` in the arguments, ``average_tokens_across_devices=False`` on several ranks,
  ``pp_size > 1``, ``torch_compile``; under tp or cp a ``compute_loss_func``, ``label_smoothing_factor``, a
  ``compute_loss`` ndparallel does not know, and under cp ``compute_metrics``, which see one rank's shard; on
  several data ranks a model whose loss takes no ``num_items_in_batch``, whose per-rank means differ).

docs/accelerate-migration.md#the-transformers-trainer.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndparallel.accelerator.core import Accelerator
from ndparallel.accelerator.saving import save_model
from ndparallel.accelerator.trainer_accelerator import TrainerAccelerator
from ndparallel.accelerator.trainer_checks import refuse_shard_blind_losses, refuse_unsupported_arguments
from ndparallel.accelerator.trainer_eval import check_eval_size, dataset_order, full_tensors, in_dataset_order
from ndparallel.accelerator.trainer_pipeline import is_pipeline, pipeline_loss, refuse_pipeline_features
from ndparallel.accelerator.trl_adapter import adapt_trl_trainer
from ndparallel.checkpoint import load as load_checkpoint
from ndparallel.checkpoint import save as save_checkpoint
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.parallel.loss import scaled_by_caller
from ndparallel.parallel.protocol import family_for

__all__ = ["STATE_FOLDER", "NDParallelTrainerMixin", "TrainerAccelerator", "trainer_class"]

STATE_FOLDER = "ndp_state"  # inside the Trainer's checkpoint-N: the optimizer (and model), DCP, any mesh
_SCHEDULER = "scheduler.pt"  # the Trainer's own name


class NDParallelTrainerMixin:
    """Put before a ``transformers.Trainer`` (sub)class: ``Trainer(..., parallelism_config=cfg)`` trains with
    ndparallel's engine (see the module docstring)."""

    def __init__(self, *args: Any, parallelism_config: ParallelismConfig | None = None, **kwargs: Any):
        if parallelism_config is not None and not isinstance(parallelism_config, ParallelismConfig):
            raise ConfigError(
                f"parallelism_config must be ndparallel's ParallelismConfig, got {type(parallelism_config).__name__}"
            )
        self._ndp_config = parallelism_config or ParallelismConfig()
        super().__init__(*args, **kwargs)
        # at Trainer(...), before the first step: every rank builds the same trainer, so every rank refuses alike
        refuse_shard_blind_losses(self, self.accelerator.parallelism_config)
        if self.accelerator.parallelism_config.pp_size > 1:
            refuse_pipeline_features(self)
        adapt_trl_trainer(self, self.accelerator.mesh)

    # ---------------------------------------------------------------- the engine
    def create_accelerator_and_postprocess(self) -> None:
        """ndparallel's Accelerator from ``parallelism_config``. ``bf16=True`` in the arguments is one process's
        bf16: the forward under ``torch.autocast`` with fp32 parameters; ``ParallelismConfig(mixed_precision=
        "bf16")`` is FSDP2's bf16 compute instead (docs/fine-tuning.md#bf16)."""
        asked = self.args.mixed_precision
        autocast = asked == "bf16" and self._ndp_config.mixed_precision == "no"
        accelerator = Accelerator(
            self._ndp_config,
            mixed_precision=None if asked == "no" or autocast else asked,
            gradient_accumulation_steps=1,  # the Trainer accumulates (and scales the loss) itself
            cpu=bool(self.args.use_cpu),
            use_seedable_sampler=True,  # the Trainer's default (AcceleratorConfig); dataset_order relies on it
        )
        refuse_unsupported_arguments(self.args, accelerator.parallelism_config, accelerator.num_processes)
        self.accelerator = TrainerAccelerator(accelerator, autocast=torch.bfloat16 if autocast else None)
        self.gather_function = self.accelerator.gather_for_metrics
        self.is_deepspeed_enabled = self.is_fsdp_enabled = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The base class's ``compute_loss`` with ndparallel's loss in the Trainer's convention (each rank's
        ``sum / num_items_in_batch``, scaled by ``dp x cp`` by the Trainer), per-rank metric sums gathered over
        ``dp_cp`` under cp, and an MoE's global router aux loss counted once."""
        config = self.accelerator.parallelism_config
        refuse_shard_blind_losses(self, config)  # also a compute_loss_func set after Trainer(...)
        if model.training and self.accelerator.mesh.size("dp_cp") > 1 and not self.model_accepts_loss_kwargs:
            raise ConfigError(
                f"{type(self.accelerator.unwrap_model(model)).__name__}'s forward takes no num_items_in_batch: each of "
                "the dp x cp ranks would average its own tokens, which is one process's loss only when every rank "
                "has as many; give its forward **kwargs (and its loss num_items_in_batch), or train on one data rank"
            )
        if is_pipeline(model):  # the model call runs the pipeline schedule, backward included (trainer_pipeline.py)
            loss = pipeline_loss(model, inputs, num_items_in_batch)
            return (loss, None) if return_outputs else loss
        scale = self._token_loss_scale(num_items_in_batch)
        router = self._router_aux_coef(model) if scale != 1 else None
        shares = self.accelerator.shares_of_the_batch() if config.cp_size > 1 else contextlib.nullcontext()
        with scaled_by_caller(), shares:
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs or bool(router), num_items_in_batch=num_items_in_batch
            )
        loss, outputs = result if (return_outputs or router) else (result, None)
        if router:
            loss = self._unscale_router_loss(loss, outputs, scale, router)
        return (loss, outputs) if return_outputs else loss

    def _prepare_context_parallel_inputs(self, model, inputs):
        """Under cp, ``shift_labels`` made from ``labels`` before the batch is sharded (transformers does so only
        for Accelerate's ``cp_backend="torch"``): a loss computed outside the model (TRL's fused LM head) then
        pairs each rank's positions with their own next tokens."""
        if self.accelerator.parallelism_config.cp_size > 1 and "labels" in inputs and "shift_labels" not in inputs:
            inputs["shift_labels"] = F.pad(inputs["labels"], (0, 1), value=-100)[:, 1:].contiguous()
        return super()._prepare_context_parallel_inputs(model, inputs)

    def _token_loss_scale(self, num_items_in_batch) -> float:
        """What transformers' ``compute_loss`` multiplied each rank's loss by (its rule, Trainer 5.25)."""
        args = self.args
        if not (args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or self.compute_loss_func)):
            return 1.0
        if num_items_in_batch is None:
            return 1.0
        return float(self.accelerator.num_processes // self.get_tp_size() if args.n_gpu <= 1 else args.n_gpu)

    def _router_aux_coef(self, model) -> float | None:
        """The router aux loss coefficient of an HF MoE that adds its aux loss to ``outputs.loss``, or None."""
        unwrapped = self.accelerator.unwrap_model(model)
        coef = getattr(unwrapped, "router_aux_loss_coef", None)
        return coef if coef and getattr(getattr(unwrapped, "config", None), "output_router_logits", False) else None

    @staticmethod
    def _unscale_router_loss(loss, outputs, scale: float, coef: float):
        """An HF MoE's router aux loss in ``outputs.loss`` is the global batch's, the same on every rank
        (ndparallel/models/hf/moe.py); the Trainer's scaling is meant for per-rank token sums, so it would
        multiply that term by ``scale``: take the excess back out, gradient included."""
        aux = getattr(outputs, "aux_loss", None) if hasattr(outputs, "keys") else None
        if aux is None or getattr(outputs, "loss", None) is None:
            return loss
        return loss - (scale - 1) * coef * aux.to(loss.device)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        refuse_shard_blind_losses(self, self.accelerator.parallelism_config)  # compute_metrics set after Trainer(...)
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(data, str):  # transformers' evaluate() recurses with the name of one of its eval datasets
            data = self.eval_dataset[data]
        self._check_eval_data(data, "the eval dataset")
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
        """transformers' ``predict``, its rows put back in the dataset's order."""
        if self.accelerator.parallelism_config.cp_size > 1:
            raise ConfigError(
                "predict() under cp_size > 1 would return one cp rank's shard of each sequence: predict with "
                "cp_size=1 (a model trained under cp loads on any mesh)"
            )
        if self.accelerator.parallelism_config.pp_size > 1:
            raise ConfigError(
                "predict() under pp_size > 1: the logits stay on the last stage inside torch's schedule; predict with "
                "pp_size=1 (save_model writes full weights that load on any mesh)"
            )
        dp = self.accelerator.mesh.size("dp")
        self._check_eval_data(test_dataset, "the test dataset")
        if dp > 1 and self.args.train_sampling_strategy == "group_by_length":  # then eval rows are grouped too
            raise ConfigError(
                f"predict() on dp={dp} ranks with train_sampling_strategy='group_by_length': the eval loader groups "
                "rows by length, and ndparallel puts gathered rows back in the dataset's order only for sequential "
                "evaluation; predict with another train_sampling_strategy"
            )
        out = super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        if dp == 1:
            return out
        inverse = np.argsort(dataset_order(len(test_dataset), dp, self.args.eval_batch_size))
        return type(out)(
            predictions=in_dataset_order(out.predictions, inverse),
            label_ids=in_dataset_order(out.label_ids, inverse),
            metrics=out.metrics,
            **({"num_samples": out.num_samples} if hasattr(out, "num_samples") else {}),
        )

    def _check_eval_data(self, data: Any, what: str) -> None:
        batch, drop = self.args.eval_batch_size, self.args.dataloader_drop_last
        check_eval_size(data, self.accelerator.mesh.size("dp"), what, batch, drop)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        cp = self.accelerator.parallelism_config.cp_size
        if is_pipeline(self.model_wrapped):  # forward only through the schedule: the loss (trainer_pipeline.py)
            pipeline = self.model_wrapped  # the evaluation loop hands over self.model: the unsplit model
            pipeline.eval()
            with torch.no_grad():
                return pipeline_loss(pipeline, self._prepare_inputs(inputs), None).detach(), None, None
        if cp == 1:
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return loss, full_tensors(logits), labels
        loss = self._cp_eval_loss(model, inputs)
        if loss is not None:  # each cp rank holds its share of the batch's loss (compute_loss)
            dist.all_reduce(loss, group=self.accelerator.mesh["cp"].get_group())
            loss = loss / cp
        return loss, None, None

    def _cp_eval_loss(self, model, inputs) -> torch.Tensor | None:
        """The loss of one eval batch under cp, as transformers' ``prediction_step`` computes it (counted over the
        global batch, then sharded), whatever the base class's own ``prediction_step`` does (TRL's shards nothing)."""
        inputs = self._prepare_inputs(inputs)
        if "labels" not in inputs and "shift_labels" not in inputs:
            return None
        num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        with torch.no_grad(), self.compute_loss_context_manager(), cp_context():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss.detach().mean().clone()

    def _load_best_model(self) -> None:
        """The best checkpoint's weights from its ``ndp_state`` (the Trainer's own path reads full tensors into
        what are sharded parameters here)."""
        state = os.path.join(self.state.best_model_checkpoint, STATE_FOLDER)
        if not os.path.isdir(state):
            raise ConfigError(
                f"load_best_model_at_end: {self.state.best_model_checkpoint!r} has no {STATE_FOLDER}/ (ndparallel's "
                "model and optimizer state); it was not saved by ndparallel.hf.Trainer"
            )
        load_checkpoint(state, self.model, restore_rng=False)

    def _clip_grad_norm(self, model):
        return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        return grad_norm

    # ---------------------------------------------------------------- saving and resuming
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every rank (full tensors are gathered); rank 0 writes transformers' layout, tokenizer and arguments."""
        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = output_dir or self.args.output_dir
        if is_pipeline(self.model_wrapped):  # every stage's full tensors, gathered to rank 0
            save_model(self.model_wrapped, output_dir)
            if self.args.should_save:
                self.model.config.save_pretrained(output_dir)
        else:
            family_for(self.model).save_pretrained(self.model, output_dir)  # Hugging Face's: gathered, rank 0 writes
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if is_pipeline(self.model_wrapped):  # this rank's stages and their views of the optimizer
            self.accelerator.save_state(os.path.join(output_dir, STATE_FOLDER))
        else:
            save_checkpoint(os.path.join(output_dir, STATE_FOLDER), self.model, self.optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights come from ``ndp_state/`` with the optimizer (below); an unreadable ``model.safetensors``
        (truncated) is named and skipped for it, instead of safetensors' bare error (docs/troubleshooting.md)."""
        problem = family_for(self.model).unreadable_weights(resume_from_checkpoint)
        if problem is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not os.path.isdir(os.path.join(resume_from_checkpoint, STATE_FOLDER)):
            raise ConfigError(f"{problem}; and the checkpoint has no {STATE_FOLDER}/ to load the weights from")
        warnings.warn(f"{problem}: its weights are read from {STATE_FOLDER}/ instead", UserWarning, stacklevel=2)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, STATE_FOLDER)
        if not os.path.isdir(state):
            raise ConfigError(
                f"{checkpoint!r} has no {STATE_FOLDER}/ (the optimizer state ndparallel's Trainer writes): resume from "
                "a checkpoint saved by ndparallel.hf.Trainer, or start without resume_from_checkpoint"
            )
        if is_pipeline(self.model_wrapped):
            self.accelerator.load_state(state)
        else:
            load_checkpoint(state, self.model, self.optimizer)
        scheduler = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def trainer_class(base: type, name: str | None = None) -> type:
    """``base`` (``transformers.Trainer`` or a subclass, e.g. ``trl.SFTTrainer``) with ndparallel's engine."""
    return type(name or base.__name__, (NDParallelTrainerMixin, base), {"__module__": __name__})
