"""The 🤗 transformers ``Trainer`` (and trainers built on it, e.g. TRL's) with ndparallel's engine underneath.

``trainer_class(transformers.Trainer)`` is the Trainer with one thing changed: the accelerator it builds in
``create_accelerator_and_postprocess`` is ndparallel's :class:`~ndparallel.accelerator.core.Accelerator` (behind
:class:`TrainerAccelerator`, which adds the Accelerate attributes the Trainer reads), made from the
``parallelism_config=`` the Trainer is given. Everything else (the loop, logging, callbacks, schedulers) is the
Trainer's own. What the engine changes, the mixin says here:

* **the loss** under cp: ndparallel's HF loss returns ``cp x`` this rank's token sum ``/ num_items_in_batch``
  (its cp ranks share a batch, ``ndparallel/models/hf/loss.py``); the Trainer already multiplies every rank's
  loss by ``dp x cp`` (Accelerate's convention), so the mixin divides by cp once: the gradient is one process's;
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
* **refused by name**: what would train something else than one process or that this engine does not run
  (DeepSpeed, the Trainer's FSDP arguments, Accelerate's ``parallelism_config`` in the arguments,
  ``average_tokens_across_devices=False`` on several ranks, ``pp_size > 1``, ``torch_compile``; under tp or cp a
  ``compute_loss_func`` or ``label_smoothing_factor``, which see one rank's logits; on several data ranks a model
  whose loss takes no ``num_items_in_batch``, whose per-rank means differ from one process's).

docs/accelerate-migration.md#the-transformers-trainer.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndparallel.accelerator.core import Accelerator
from ndparallel.checkpoint import load as load_checkpoint
from ndparallel.checkpoint import save as save_checkpoint
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = ["STATE_FOLDER", "NDParallelTrainerMixin", "TrainerAccelerator", "dataset_order", "trainer_class"]

STATE_FOLDER = "ndp_state"  # inside the Trainer's checkpoint-N: the optimizer (and model), DCP, any mesh
_SCHEDULER = "scheduler.pt"  # the Trainer's own name


class _TrainerParallelismConfig:
    """ndparallel's resolved config, plus the names the Trainer and TRL read of Accelerate's (sequence parallel:
    none here; ``to_json`` for the arguments' dump)."""

    sp_size, sp_enabled, sp_backend = 1, False, None

    def __init__(self, config: ParallelismConfig):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def to_json(self) -> dict[str, Any]:
        return self._config.to_dict()


class _GradientState:
    """What the Trainer drives of Accelerate's ``gradient_state``: it decides itself when a micro-batch syncs."""

    plugin_kwargs: dict[str, Any] = {}

    def __init__(self, accelerator: Accelerator):
        self._accelerator = accelerator

    def _set_sync_gradients(self, sync: bool) -> None:  # the Trainer's name
        self._accelerator.sync_gradients = bool(sync)

    @property
    def sync_gradients(self) -> bool:
        return self._accelerator.sync_gradients

    @property
    def end_of_dataloader(self) -> bool:
        return self._accelerator._end_of_loader


class TrainerAccelerator:
    """ndparallel's :class:`Accelerator` with the Accelerate attributes the Trainer reads; the rest delegates."""

    def __init__(self, accelerator: Accelerator):
        from accelerate.utils import DistributedType  # the Trainer compares with Accelerate's enum

        self._accelerator = accelerator
        self.gradient_state = _GradientState(accelerator)
        self.state = types.SimpleNamespace(fsdp_plugin=None, deepspeed_plugin=None)  # neither: ndparallel shards
        self.scaler = None  # bf16 needs none; fp16 is refused without FSDP, unscaled with it (docs/mixed-precision)
        self.optimizer_step_was_skipped = False
        self.distributed_type = DistributedType.MULTI_GPU if accelerator.num_processes > 1 else DistributedType.NO
        self.parallelism_config = _TrainerParallelismConfig(accelerator.parallelism_config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    @property
    def sync_gradients(self) -> bool:
        return self._accelerator.sync_gradients

    def prepare(self, *objects: Any) -> Any:
        """``Accelerator.prepare`` of what is not prepared yet: the Trainer prepares again after ``evaluate()``
        or in a second ``train()``; what was prepared is returned as it is."""
        done = [obj if _is_prepared(obj) else None for obj in objects]
        todo = [obj for obj, kept in zip(objects, done, strict=True) if kept is None]
        fresh = iter(_as_tuple(self._accelerator.prepare(*todo)) if todo else ())
        out = [kept if kept is not None else next(fresh) for kept in done]
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, device_placement: Any = None, evaluation_mode: bool = False):
        return self.prepare(model)

    def free_memory(self, *objects: Any) -> tuple:
        """The Trainer frees Accelerate's references between runs; ndparallel keeps its prepared model (its
        parameters are the sharded ones), so nothing is dropped."""
        return objects

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Over the world, as Accelerate's (the Trainer divides token counts by tp x cp itself)."""
        return _all_gather(tensor, None)

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """Over ``dp`` (each sample once: tp/cp ranks share a batch); 0-dim tensors as one element each; tuples,
        lists and dicts (a model's extra outputs) element by element, as Accelerate's."""
        if isinstance(data, (tuple, list)):
            return _rebuilt(data, [self.gather_for_metrics(d, use_gather_object) for d in data])
        if isinstance(data, dict):
            return type(data)({k: self.gather_for_metrics(v, use_gather_object) for k, v in data.items()})
        if not isinstance(data, torch.Tensor):
            return data
        return _all_gather(data, self._accelerator.mesh["dp"].get_group())

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad ``tensor`` along ``dim`` to the longest over the world (Accelerate's contract; nested alike)."""
        if isinstance(tensor, (tuple, list)):
            return _rebuilt(tensor, [self.pad_across_processes(t, dim, pad_index, pad_first) for t in tensor])
        if isinstance(tensor, dict):
            return type(tensor)({k: self.pad_across_processes(v, dim, pad_index, pad_first) for k, v in tensor.items()})
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        missing = int(size.item()) - tensor.shape[dim]
        if missing == 0:
            return tensor
        pad = [0, 0] * (tensor.dim() - dim - 1) + ([missing, 0] if pad_first else [0, missing])
        return torch.nn.functional.pad(tensor, pad, value=pad_index)


def _rebuilt(sequence: tuple | list, items: list) -> tuple | list:
    """``sequence``'s type (a namedtuple too) holding ``items``."""
    return type(sequence)(*items) if hasattr(sequence, "_fields") else type(sequence)(items)


def _is_prepared(obj: Any) -> bool:
    from ndparallel.accelerator.core import _PREPARED
    from ndparallel.accelerator.data import EpochLoader

    return bool(getattr(obj, _PREPARED, False)) or isinstance(obj, EpochLoader)


def _as_tuple(result: Any) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts)


def _refuse_unsupported(args: Any, config: ParallelismConfig, world_size: int) -> None:
    """One-line refusals of Trainer arguments this engine does not run or that would train something else."""
    if getattr(args, "deepspeed", None):
        raise ConfigError("deepspeed= is not ndparallel's engine: drop it; shard with parallelism_config instead")
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_config", None) not in (None, {}):
        raise ConfigError(
            "fsdp= / fsdp_config= configure Accelerate's FSDP, which ndparallel replaces: drop them and set "
            "parallelism_config=ParallelismConfig(dp_shard_size=...) (FSDP2 per block)"
        )
    if getattr(args, "parallelism_config", None) is not None:
        raise ConfigError(
            "TrainingArguments(parallelism_config=...) is Accelerate's: pass ndparallel's ParallelismConfig to the "
            "Trainer itself (Trainer(..., parallelism_config=cfg))"
        )
    if getattr(args, "torch_compile", False):
        raise ConfigError(
            "torch_compile=True is not routed through ndparallel: set parallelism_config compile='blocks'"
        )
    if world_size > 1 and not getattr(args, "average_tokens_across_devices", True):
        raise ConfigError(
            "average_tokens_across_devices=False divides each rank's loss by its own tokens, so the gradient "
            "differs from one process's: keep the default (True)"
        )
    if config.pp_size > 1:
        raise ConfigError(
            f"pp_size={config.pp_size}: the Trainer's loop runs one forward and backward per micro-batch, a "
            "pipeline runs them all in one call; use ndparallel.Accelerator or ndparallel train for pp"
        )


def _refuse_loss_overrides(trainer: Any, config: ParallelismConfig) -> None:
    """A loss the Trainer computes from the logits itself sees one rank's shard of them under tp or cp."""
    if config.tp_size == 1 and config.cp_size == 1:
        return
    mesh = f"tp_size={config.tp_size}, cp_size={config.cp_size}"
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ConfigError(
            f"compute_loss_func under {mesh} would see this rank's shard of the logits (vocabulary under tp, sequence "
            "under cp), not the batch's: use the model's own loss (labels=), or tp_size=cp_size=1"
        )
    if getattr(trainer.args, "label_smoothing_factor", 0):
        raise ConfigError(
            f"label_smoothing_factor={trainer.args.label_smoothing_factor} under {mesh}: the Trainer's label smoother "
            "works on one rank's shard of the logits; set it to 0, or use tp_size=cp_size=1"
        )


def _check_eval_size(dataset: Any, dp: int, what: str, batch: int = 1, drop_last: bool = False) -> None:
    """The dp sampler drops the last ``len % dp`` samples of a pass, and ``dataloader_drop_last`` each rank's
    last partial batch: refused for evaluation and prediction (those samples would not be evaluated)."""
    if dataset is None or dp == 1 or not hasattr(dataset, "__len__"):
        return
    datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
    for data in datasets:
        if len(data) % dp:
            raise ConfigError(
                f"{what} has {len(data)} samples, which dp={dp} data ranks do not divide: the last {len(data) % dp} "
                f"would not be evaluated; use a multiple of {dp} samples"
            )
        if drop_last and (len(data) // dp) % batch:
            raise ConfigError(
                f"{what}: dataloader_drop_last drops each rank's last {(len(data) // dp) % batch} samples (of "
                f"{len(data) // dp} per rank in batches of {batch}); use a multiple of dp x eval batch = {dp * batch} "
                "samples, or dataloader_drop_last=False"
            )


def dataset_order(samples: int, dp: int, batch: int) -> np.ndarray:
    """The dataset index of each row the evaluation loop gathers: step by step, each dp rank's batch in rank
    order, rank ``r`` holding samples ``r, r + dp, ...`` (the prepared loader's sampler)."""
    per_rank = samples // dp
    order = []
    for start in range(0, per_rank, batch):
        for rank in range(dp):
            order += [rank + dp * i for i in range(start, min(start + batch, per_rank))]
    return np.asarray(order)


def _in_dataset_order(value: Any, inverse: np.ndarray) -> Any:
    """``value``'s rows (one per sample) in the dataset's order; an array whose rows are not the samples (an MoE's
    ``router_logits``, one row per token) cannot be put back and is refused."""
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_in_dataset_order(v, inverse) for v in value])
    if isinstance(value, np.ndarray) and value.ndim:
        if value.shape[0] != len(inverse):
            raise ConfigError(
                f"predict() on several data ranks returned an output of {value.shape[0]} rows for {len(inverse)} "
                "samples (e.g. router_logits, one row per token): its rows cannot be put back in the dataset's order; "
                "leave it out of the outputs (output_router_logits=False), or predict on one data rank"
            )
        return value[inverse]
    return value


def _full_tensors(value: Any) -> Any:
    """Vocabulary-sharded logits (tp) as full tensors, inside the Trainer's nested outputs."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_full_tensors(v) for v in value])
    return value


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

    # ---------------------------------------------------------------- the engine
    def create_accelerator_and_postprocess(self) -> None:
        accelerator = Accelerator(
            self._ndp_config,
            mixed_precision=None if self.args.mixed_precision == "no" else self.args.mixed_precision,
            gradient_accumulation_steps=1,  # the Trainer accumulates (and scales the loss) itself
            cpu=bool(self.args.use_cpu),
            use_seedable_sampler=True,  # the Trainer's default (AcceleratorConfig); dataset_order relies on it
        )
        _refuse_unsupported(self.args, accelerator.parallelism_config, accelerator.num_processes)
        self.accelerator = TrainerAccelerator(accelerator)
        self.gather_function = self.accelerator.gather_for_metrics
        self.is_deepspeed_enabled = self.is_fsdp_enabled = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        config = self.accelerator.parallelism_config
        _refuse_loss_overrides(self, config)
        if model.training and self.accelerator.mesh.size("dp_cp") > 1 and not self.model_accepts_loss_kwargs:
            raise ConfigError(
                f"{type(self.accelerator.unwrap_model(model)).__name__}'s forward takes no num_items_in_batch: each of "
                "the dp x cp ranks would average its own tokens, which is one process's loss only when every rank "
                "has as many; give its forward **kwargs (and its loss num_items_in_batch), or train on one data rank"
            )
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        scale = self._token_loss_scale(num_items_in_batch)
        cp = config.cp_size
        if cp > 1 and num_items_in_batch is not None:  # the Trainer scaled by dp x cp already (module docstring)
            loss, scale = loss / cp, scale / cp
        loss = self._unscale_router_loss(model, loss, outputs, scale)
        return (loss, outputs) if return_outputs else loss

    def _token_loss_scale(self, num_items_in_batch) -> float:
        """What transformers' ``compute_loss`` multiplied each rank's loss by (its rule, Trainer 5.25)."""
        args = self.args
        if not (args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or self.compute_loss_func)):
            return 1.0
        if num_items_in_batch is None:
            return 1.0
        return float(self.accelerator.num_processes // self.get_tp_size() if args.n_gpu <= 1 else args.n_gpu)

    def _unscale_router_loss(self, model, loss, outputs, scale: float):
        """An HF MoE's router aux loss in ``outputs.loss`` is the global batch's, the same on every rank
        (ndparallel/models/hf/moe.py); the Trainer's scaling is meant for per-rank token sums, so it would
        multiply that term by ``scale``: take the excess back out, gradient included."""
        aux = getattr(outputs, "aux_loss", None) if hasattr(outputs, "keys") else None
        coef = getattr(self.accelerator.unwrap_model(model), "router_aux_loss_coef", None)
        if scale == 1 or aux is None or not coef or getattr(outputs, "loss", None) is None:
            return loss
        return loss - (scale - 1) * coef * aux.to(loss.device)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        if self.accelerator.parallelism_config.cp_size > 1 and self.compute_metrics is not None:
            raise ConfigError(
                "compute_metrics under cp_size > 1 would see one cp rank's shard of each sequence's predictions: "
                "evaluate the loss only (compute_metrics=None), or evaluate with cp_size=1"
            )
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
            predictions=_in_dataset_order(out.predictions, inverse),
            label_ids=_in_dataset_order(out.label_ids, inverse),
            metrics=out.metrics,
            **({"num_samples": out.num_samples} if hasattr(out, "num_samples") else {}),
        )

    def _check_eval_data(self, data: Any, what: str) -> None:
        batch, drop = self.args.eval_batch_size, self.args.dataloader_drop_last
        _check_eval_size(data, self.accelerator.mesh.size("dp"), what, batch, drop)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        cp = self.accelerator.parallelism_config.cp_size
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only or cp > 1, ignore_keys)
        if cp > 1 and loss is not None:  # each cp rank holds its share of the batch's loss (module docstring)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.accelerator.mesh["cp"].get_group())
            loss = loss / cp
        return loss, _full_tensors(logits), labels

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

        from ndparallel.models.hf.pretrained import save_pretrained

        output_dir = output_dir or self.args.output_dir
        save_pretrained(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(os.path.join(output_dir, STATE_FOLDER), self.model, self.optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights come from ``ndp_state/`` with the optimizer (below); an unreadable ``model.safetensors``
        (truncated) is named and skipped for it, instead of safetensors' bare error (docs/troubleshooting.md)."""
        from ndparallel.models.hf.pretrained import unreadable_weights

        problem = unreadable_weights(resume_from_checkpoint)
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
        load_checkpoint(state, self.model, self.optimizer)
        scheduler = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def trainer_class(base: type, name: str | None = None) -> type:
    """``base`` (``transformers.Trainer`` or a subclass, e.g. ``trl.SFTTrainer``) with ndparallel's engine."""
    return type(name or base.__name__, (NDParallelTrainerMixin, base), {"__module__": __name__})
