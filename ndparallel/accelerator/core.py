"""The Accelerator: 🤗 Accelerate's object for hand-written loops, built on the ndparallel mesh.

The difference from Accelerate is where collectives run: data is split over the ``dp`` view (ranks of one
tensor/context-parallel group get the same batch), metrics are gathered over ``dp`` and reduced over
``dp_cp``, and gradient clipping is exact across meshes. docs/accelerate-migration.md lists every keyword
and method with its Accelerate counterpart.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from ndparallel import checkpoint
from ndparallel.accelerator import data, precision, saving, stepping, trackers
from ndparallel.accelerator.hf_load import serve_tp_plan_loads
from ndparallel.accelerator.options import (
    FullyShardedDataParallelPlugin,
    apply_settings,
    check_accelerate_options,
)
from ndparallel.accelerator.pipeline import PipelineModel, loss_kind, prepare_pipeline
from ndparallel.accelerator.stage_optim import StageViews, merge_views, stage_views
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.precision import forward_autocast_dtype, parallelize_config
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.process import destroy_distributed, init_distributed
from ndparallel.errors import ConfigError
from ndparallel.models.hf.tp_plan import is_hf_model
from ndparallel.parallel.clip import clip_grad_norm_
from ndparallel.parallel.context_parallel import context_parallel
from ndparallel.parallel.grad_sync import micro_batch_sync, no_sync
from ndparallel.parallel.parallelize import find_blocks, parallelize

__all__ = ["Accelerator"]


def _check_pp_accumulation(pp_size: int, steps: int) -> None:
    """Under pp one model call is a whole pipeline step: accumulation is the pipeline's micro-batching."""
    if pp_size > 1 and steps != 1:
        raise ConfigError(
            f"gradient_accumulation_steps={steps} with pp_size={pp_size}: under pipeline parallelism the accumulation "
            "is the pipeline's micro-batching; set gradient_accumulation_steps=1 and pp_microbatches (the number of "
            "micro-batches one model call splits its batch into)"
        )


_PREPARED = "_ndp_prepared"  # set on a model prepare() took and on what it returned: a second prepare is refused


def _check_not_prepared(obj: Any) -> None:
    """Refuse a model that prepare() already took or returned (its parameters are already split and wrapped)."""
    if isinstance(obj, PipelineModel) or getattr(obj, _PREPARED, False):
        raise ConfigError(
            f"this {type(obj).__name__} was already prepared: call prepare once per model, with the plain model, "
            "and keep using the object that call returned"
        )


class Accelerator:
    """Mesh, device, mixed precision, gradient accumulation, trackers and checkpoints for a hand-written loop.

    ``Accelerator(parallelism_config, mixed_precision=, gradient_accumulation_steps=, log_with=, project_dir=,
    fsdp_plugin=, cpu=)`` take Accelerate's meaning; ``device_type=`` and ``mesh=`` are ndparallel's. Other
    Accelerate keywords are accepted at their default value and refused by name otherwise.
    """

    def __init__(
        self,
        parallelism_config: ParallelismConfig | None = None,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        cpu: bool = False,
        device_type: str | None = None,
        mesh: Mesh | None = None,
        **accelerate_options: Any,
    ):
        check_accelerate_options(accelerate_options)
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ConfigError(f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be an integer >= 1")
        self._tracker_entries = trackers.tracker_names(log_with, project_dir)
        cfg = parallelism_config or (mesh.config if mesh is not None else ParallelismConfig())
        if fsdp_plugin is not None:
            cfg = apply_settings(cfg, fsdp_plugin.settings, "fsdp_plugin")
        cfg = precision.merge_mixed_precision(cfg, mixed_precision)
        _check_pp_accumulation(cfg.pp_size, gradient_accumulation_steps)  # before any rank builds a mesh
        device_type = "cpu" if cpu else (device_type or os.environ.get("NDP_DEVICE") or None)  # launch --cpu-ranks
        self.mesh = mesh or init_distributed(cfg, device_type=device_type)
        trackers.check_logging_dir(self._tracker_entries, project_dir)
        self._config = cfg.resolve(self.mesh.size())
        _check_pp_accumulation(self._config.pp_size, gradient_accumulation_steps)
        self._autocast = forward_autocast_dtype(self._config)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.project_dir = None if project_dir is None else str(project_dir)
        self.step = 0  # micro-batches seen inside accumulate() since the last sync at the end of a loader
        self.sync_gradients = True
        self.trackers: list[Any] = []
        self._end_of_loader = False
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        serve_tp_plan_loads()  # from_pretrained(tp_plan="auto", device_mesh=self.torch_device_mesh) -> prepare()

    # ------------------------------------------------------------------ where am I
    @property
    def device(self) -> torch.device:
        return self.mesh.device

    @property
    def parallelism_config(self) -> ParallelismConfig:
        """The resolved config (no -1), with Accelerate's ``dp_cp_dim_names``, ``non_data_parallel_size``..."""
        return self._config

    @property
    def torch_device_mesh(self) -> Mesh:
        """The named mesh: ``["dp_cp"]``, ``["tp"]``... are torch DeviceMeshes (every dim, also of size 1). Passed
        as ``from_pretrained(tp_plan="auto", device_mesh=...)``, the load is left to ``prepare()`` (hf_load.py)."""
        serve_tp_plan_loads()  # transformers may have been imported after the Accelerator was made
        return self.mesh

    @property
    def mixed_precision(self) -> str:
        return self._config.mixed_precision

    @property
    def process_index(self) -> int:
        return dist.get_rank()

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.process_index))

    @property
    def num_processes(self) -> int:
        return dist.get_world_size()

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def logging_dir(self) -> str | None:
        return self.project_dir

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first; the others enter it once it has left."""
        if not self.is_main_process:
            dist.barrier()
        yield
        if self.is_main_process:
            dist.barrier()

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any) -> Any:
        """Parallelise models, re-point optimizers at the new parameters, shard data loaders over ``dp``.

        Returns the objects in the same order (one object: that object). Models are parallelised in place
        (FSDP2 and TP replace parameters by DTensors), so an optimizer built before ``prepare`` is re-pointed
        at the new parameters by name. Optimizers and schedulers step only when gradients sync.
        """
        for obj in objects:
            _check_not_prepared(obj)
        models = [o for o in objects if isinstance(o, nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        for optimizer in optimizers:  # before any model changes
            stepping.check_parameters(optimizer, [*self._models, *models])
        if optimizers:
            stepping.warn_unstepped([*self._models, *models], [*self._optimizers, *optimizers])
        names_before = {id(p): (i, n) for i, m in enumerate(models) for n, p in m.named_parameters()}
        prepared, prepared_models = [], []
        for obj in objects:
            if isinstance(obj, nn.Module):
                plain, obj = obj, self._prepare_model(obj)
                setattr(plain, _PREPARED, True)
                setattr(obj, _PREPARED, True)
                prepared_models.append(obj)
            elif isinstance(obj, DataLoader):
                obj = data.shard_loader(
                    obj, self.mesh.size("dp"), self.mesh.local_rank("dp"), self.device, self._set_end_of_loader
                )
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                stepping.step_only_when_syncing(obj, ("step",), lambda: self.sync_gradients)
                self._schedulers.append(obj)
            prepared.append(obj)
        params_after = [_parameters_by_name(m) for m in prepared_models]
        for obj in optimizers:
            stepping.repoint(obj, names_before, params_after, drop_absent=self._pp)
            stepping.step_only_when_syncing(obj, ("step", "zero_grad"), lambda: self.sync_gradients)
            self._optimizers.append(obj)
        self._models.extend(prepared_models)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    @property
    def _pp(self) -> bool:
        return self._config.pp_size > 1

    def _prepare_model(self, model: nn.Module) -> nn.Module | PipelineModel:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ConfigError(
                f"{type(model).__name__} is already sharded (DTensor parameters, e.g. transformers' tp_plan): pass "
                "device_mesh=accelerator.torch_device_mesh to from_pretrained; prepare() then applies ndparallel's plan"
            )
        if self._pp:  # this rank's stages behind one call that runs the pipeline step (pipeline.py)
            return prepare_pipeline(model, self._config, self.mesh)
        # Without FSDP the forward autocasts (below); FSDP casts through its policy.
        cfg = parallelize_config(self._config)
        model = parallelize(model.to(self.device), cfg, mesh=self.mesh, blocks=self._blocks(model))
        if self._autocast is not None:
            precision.wrap_autocast(model, self.device.type, self._autocast)
        if is_hf_model(model):
            saving.install_save_pretrained(model)
        return model

    def _blocks(self, model: nn.Module) -> list | None:
        """None (parallelize finds the transformer blocks), or [] for a model without a block list when
        nothing needs blocks: FSDP then shards it as one unit, as Accelerate prepares any module."""
        try:
            find_blocks(model)
        except ConfigError:
            if self._config.activation_checkpointing != "none" or self._config.compile == "blocks":
                raise
            return []
        return None

    # ------------------------------------------------------------------ gradients
    def _set_end_of_loader(self, value: bool) -> None:
        self._end_of_loader = value

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-batch: gradients sync (and ``sync_gradients`` is True) on every
        ``gradient_accumulation_steps``-th call, and on the last batch of a prepared loader."""
        if self._end_of_loader:
            self.step, self.sync_gradients = 0, True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.gradient_accumulation_steps == 0
        with contextlib.ExitStack() as stack:
            for model in models:  # the training step's rule: FSDP reduce-scatters each micro-batch
                if not isinstance(model, PipelineModel):  # pp: one call is one whole step (accumulation 1)
                    stack.enter_context(micro_batch_sync(model, last=self.sync_gradients))
            yield

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(model, PipelineModel):
            raise ConfigError(
                "no_sync() has no meaning under pp_size > 1: one model call runs every micro-batch of the step and "
                "the pipeline syncs gradients after the last; set pp_microbatches for more micro-batches per step"
            )
        return no_sync(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with the loss divided by the accumulation steps. The ``outputs.loss`` of a
        pipeline model call (pp) is left alone: that call already ran backward through every stage."""
        kind = loss_kind(loss)
        if kind == "backward":
            return
        if kind == "eval" or (self._pp and not loss.requires_grad):
            raise ConfigError(
                "under pp_size > 1 the model call runs backward itself: pass its outputs.loss unchanged to "
                "accelerator.backward (a no-op), from a call in training mode with gradients enabled"
            )
        (loss / self.gradient_accumulation_steps).backward(**kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Exact global gradient norm over every mesh the parameters live on (and every pipeline stage); clips
        in place."""
        pp_group = self.mesh["pp"].get_group() if self._pp else None
        return clip_grad_norm_(parameters, max_norm, norm_type, pp_group=pp_group)

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` to the mixed-precision dtype where FSDP does not cast (else a no-op)."""
        return precision.autocast_context(self.device.type, self._autocast)

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: Iterable[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager:
        """Shard ``buffers`` along ``buffer_seq_dims`` over ``mesh["cp"]`` inside the block
        (:func:`ndparallel.context_parallel`); a no-op when cp is 1."""
        buffers = list(buffers or [])
        seq_dims = list(buffer_seq_dims) if buffer_seq_dims is not None else []
        return context_parallel(self.mesh, buffers, seq_dims, no_restore_buffers or ())

    # ------------------------------------------------------------------ metrics
    def gather_for_metrics(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` (dim 0) over the data-parallel ranks, in dp order.

        Ranks of one tensor/context-parallel group hold the same batch, so gathering over ``dp``
        (not the world) returns each sample once.
        """
        group = self.mesh["dp"].get_group()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        """Sum or mean of ``tensor * scale`` over ``dp_cp`` (every rank that saw different tokens)."""
        if reduction not in ("mean", "sum"):
            raise ConfigError(f"reduction={reduction!r} must be 'mean' or 'sum'")
        group = self.mesh["dp_cp"].get_group()
        result = tensor.detach().clone() * scale
        dist.all_reduce(result, group=group)
        return result / dist.get_world_size(group) if reduction == "mean" else result

    # ------------------------------------------------------------------ trackers
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the ``log_with`` trackers on the main process (files under ``project_dir/project_name``)."""
        if self.is_main_process:
            self.trackers = trackers.make_trackers(
                self._tracker_entries, project_name, self.logging_dir, init_kwargs or {}
            )
            for tracker in self.trackers:
                if config is not None:
                    tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name``; on the other processes a tracker that does nothing (as Accelerate)."""
        if not self.is_main_process:
            return trackers.BlankTracker()
        for tracker in self.trackers:
            if getattr(tracker, "name", None) == name:
                return tracker.tracker if unwrap else tracker
        raise ConfigError(f"no tracker named {name!r}: log_with has {[getattr(t, 'name', t) for t in self.trackers]}")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log ``values`` to every tracker (main process only)."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(getattr(tracker, "name", ""), {}))

    def end_training(self) -> None:
        """Finish the trackers and tear down the process group."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        destroy_distributed()

    # ------------------------------------------------------------------ weights and state
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The module prepare() returned, without the autocast forward (``keep_fp32_wrapper=False``, in place)
        or a ``torch.compile`` wrapper (``keep_torch_compile=False``). Parameters stay sharded."""
        if not keep_torch_compile:
            model = getattr(model, "_orig_mod", model)
        if not keep_fp32_wrapper:
            precision.unwrap_autocast(model)
        return model

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full (gathered) CPU tensors on the main process, ``{}`` elsewhere; every rank must call it."""
        return saving.full_state_dict(getattr(model, "_orig_mod", model))

    def save_model(
        self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size="10GB", safe_serialization=True
    ) -> None:
        """Full weights as ``model.safetensors`` (sharded above ``max_shard_size``); every rank calls it."""
        saving.save_model(getattr(model, "_orig_mod", model), save_directory, max_shard_size, safe_serialization)

    def save_state(self, path: str, **state: Any) -> str:
        """Checkpoint the prepared model, optimizer and schedulers (DCP; loadable on any mesh). Under pp: this
        rank's stage modules, with one view of the optimizer per stage (format 3, as ``ndparallel train``)."""
        model, optimizer, views = self._checkpoint_parts()
        if self._schedulers:
            state["schedulers"] = [stepping.scheduler_state(s) for s in self._schedulers]
        path = checkpoint.save(path, model, optimizer, accelerator_step=self.step, **state)
        if views is not None:
            merge_views(self._optimizers[0], views)  # a save before the first step initialises the state
        return path

    def load_state(self, path: str) -> dict[str, Any]:
        """Restore what ``save_state`` wrote; returns the extra state."""
        model, optimizer, views = self._checkpoint_parts()
        state = checkpoint.load(path, model, optimizer)
        if views is not None:
            merge_views(self._optimizers[0], views)
        for scheduler, saved in zip(self._schedulers, state.pop("schedulers", []), strict=False):
            scheduler.load_state_dict(saved)
        self.step = int(state.pop("accelerator_step", 0))
        return state

    def _checkpoint_parts(self) -> tuple[Any, Any, StageViews | None]:
        """What ``checkpoint.save``/``load`` take: the model and optimizer, or (pp) the stage modules and one
        optimizer view per stage (then also the views, to merge back)."""
        model, optimizer = self._single_model_and_optimizer()
        if not isinstance(model, PipelineModel):
            return model, optimizer, None
        if optimizer is None:
            return model.stages, None, None
        views = stage_views(optimizer, model.stages)
        return model.stages, [view for view, _ in views], views

    def _single_model_and_optimizer(self) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if len(self._models) != 1 or len(self._optimizers) > 1:
            raise ConfigError(
                f"save_state/load_state handle one prepared model and at most one optimizer, got "
                f"{len(self._models)} and {len(self._optimizers)}; call ndparallel.checkpoint.save per model"
            )
        return self._models[0], (self._optimizers[0] if self._optimizers else None)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader``'s next pass without its first ``num_batches`` batches (resuming inside an epoch)."""
        return data.skip_first_batches(dataloader, num_batches)


def _parameters_by_name(model: nn.Module | PipelineModel) -> dict[str, list[nn.Parameter]]:
    """The prepared model's parameters under the names the unprepared one gave them: under pp a tied weight's
    copies all under the weight's name (the embedding's; the one-process model lists the one tensor once)."""
    named = model.one_process_parameters() if isinstance(model, PipelineModel) else model.named_parameters()
    by_name: dict[str, list[nn.Parameter]] = {}
    for name, param in named:
        by_name.setdefault(name, []).append(param)
    return by_name
