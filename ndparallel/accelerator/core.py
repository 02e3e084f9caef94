"""The Accelerator: 🤗 Accelerate's object for hand-written loops, built on the ndparallel mesh.

Without a parallelism config it is Accelerate's ``Accelerator()``: data parallel over every rank (ndparallel's
bucketed all-reduce), or FSDP over every rank when launched with FSDP, with Accelerate's data semantics
(dealing.py). With one, data is split over the ``dp`` view (ranks of one tensor/context-parallel group get the
same batch), metrics are gathered over ``dp`` and reduced over ``dp_cp``, and gradient clipping is exact across
meshes. The names live in mixins, one concept each: processes, metrics, checkpointing, trackers, names.
docs/accelerate-migration.md lists every keyword and method with its Accelerate counterpart.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from ndparallel.accelerator import data, dealing, precision, saving, stepping, trackers
from ndparallel.accelerator.buffers import broadcast_buffers_each_forward
from ndparallel.accelerator.checkpointing import CheckpointNames
from ndparallel.accelerator.hf_load import serve_tp_plan_loads
from ndparallel.accelerator.kwargs import (
    AutocastKwargs,
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    check_fields,
)
from ndparallel.accelerator.metrics import MetricNames
from ndparallel.accelerator.names import ReportedNames
from ndparallel.accelerator.options import (
    DATA_SHORTHANDS,
    FullyShardedDataParallelPlugin,
    Handlers,
    accumulation_plugin,
    check_accelerate_options,
    data_configuration,
    project_configuration,
    resolve_config,
)
from ndparallel.accelerator.pipeline import PipelineModel, loss_kind, prepare_pipeline
from ndparallel.accelerator.processes import ProcessNames
from ndparallel.accelerator.state import AcceleratorState, GradientState, distributed_type_of
from ndparallel.config.accelerate_env import accelerate_launch_settings
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.precision import forward_autocast_dtype, parallelize_config
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.process import destroy_distributed, init_distributed
from ndparallel.errors import ConfigError
from ndparallel.parallel.clip import clip_grad_norm_
from ndparallel.parallel.context_parallel import context_parallel
from ndparallel.parallel.grad_sync import micro_batch_sync, no_sync
from ndparallel.parallel.parallelize import find_blocks, parallelize
from ndparallel.parallel.protocol import family_for

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
_UNSET = object()


def _check_not_prepared(obj: Any) -> None:
    """Refuse a model that prepare() already took or returned (its parameters are already split and wrapped)."""
    if isinstance(obj, PipelineModel) or getattr(obj, _PREPARED, False):
        raise ConfigError(
            f"this {type(obj).__name__} was already prepared: call prepare once per model, with the plain model, "
            "and keep using the object that call returned"
        )


class Accelerator(ProcessNames, MetricNames, CheckpointNames, trackers.TrackerNames, ReportedNames):
    """Mesh, device, mixed precision, gradient accumulation, data, trackers and checkpoints for a hand-written loop.

    Accelerate's keywords take Accelerate's meaning (``Accelerator()`` is data parallel over every rank);
    ``parallelism_config`` (also first positional), ``device_type=`` and ``mesh=`` are ndparallel's. Settings
    ndparallel cannot honour are refused by name.
    """

    def __init__(
        self,
        parallelism_config: ParallelismConfig | None = None,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        device_type: str | None = None,
        mesh: Mesh | None = None,
        **accelerate_options: Any,
    ):
        shorthands = {k: accelerate_options.pop(k) for k in DATA_SHORTHANDS if k in accelerate_options}
        check_accelerate_options(accelerate_options)
        self._data_config = data_configuration(dataloader_config, shorthands)
        self.project_configuration = project_configuration(project_config, project_dir)
        plugin = accumulation_plugin(gradient_accumulation_plugin, gradient_accumulation_steps)
        self.gradient_state = GradientState(plugin.num_steps, plugin.adjust_scheduler, plugin.sync_with_dataloader,
                                            plugin.sync_each_batch)  # fmt: skip
        handlers = Handlers(kwargs_handlers)
        self.ddp_handler, self.init_handler = handlers.ddp_handler, handlers.init_handler
        self.autocast_handler, self.scaler_handler = handlers.autocast_handler, handlers.scaler_handler
        self.profile_handler = handlers.profile_handler
        self.rng_types = dealing.check_rng_types(rng_types)
        self.step_scheduler_with_optimizer = bool(step_scheduler_with_optimizer)
        self.log_with = log_with
        self._tracker_entries = trackers.tracker_names(log_with, self.logging_dir)
        launch = accelerate_launch_settings()
        self._fsdp_plugin = fsdp_plugin
        self._sync_from_rank0 = launch.sync_module_states or bool(getattr(fsdp_plugin, "sync_module_states", False))
        base = parallelism_config or (mesh.config if mesh is not None else None)
        cfg = resolve_config(base, launch, fsdp_plugin, self.ddp_handler, mixed_precision)
        _check_pp_accumulation(cfg.pp_size, plugin.num_steps)  # before any rank builds a mesh
        device_type = "cpu" if cpu or launch.cpu else (device_type or os.environ.get("NDP_DEVICE") or None)
        timeout = self.init_handler.timeout if self.init_handler is not None else None
        self.mesh = mesh or init_distributed(
            cfg, device_type=device_type, timeout_s=timeout and timeout.total_seconds()
        )
        trackers.check_logging_dir(self._tracker_entries, self.logging_dir)
        self._config = cfg.resolve(self.mesh.size())
        _check_pp_accumulation(self._config.pp_size, plugin.num_steps)
        self._autocast = forward_autocast_dtype(self._config)
        self.state = AcceleratorState(self)
        self.step = 0  # micro-batches seen inside accumulate() since the last sync at the end of a loader
        self.trackers: list[Any] = []
        self.flag_tensor = None
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        self._dataloaders: list[Any] = []
        self._plain_params: dict[int, tuple[weakref.ref, int, str]] = {}  # id -> (param, model index, name)
        self._init_checkpointing()
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
    def distributed_type(self) -> Any:
        return distributed_type_of(self.num_processes, self.is_fsdp2, self.device.type)

    @property
    def mixed_precision(self) -> str:
        return self._config.mixed_precision

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        _check_pp_accumulation(self._config.pp_size, steps)
        self.gradient_state.num_steps = steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Parallelise models, re-point optimizers at the new parameters, shard data loaders over ``dp``, gate
        schedulers. Returns the objects in the same order (one object: that object). Models are parallelised in
        place (FSDP2 and TP replace parameters by DTensors), so an optimizer built before ``prepare`` is
        re-pointed at the new parameters by name. Optimizers and schedulers step only when gradients sync."""
        if device_placement is not None and not all(device_placement):
            raise ConfigError("prepare(device_placement=False): ndparallel places every prepared object on its device")
        for obj in objects:
            _check_not_prepared(obj)
        models = [o for o in objects if isinstance(o, nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        for optimizer in optimizers:  # before any model changes
            stepping.check_parameters(optimizer, [*self._models, *models], self._plain_param_ids())
        if optimizers:
            stepping.warn_unstepped([*self._models, *models], [*self._optimizers, *optimizers])
        prepared = [self.prepare_model(o) if isinstance(o, nn.Module) else o for o in objects]
        for index, obj in enumerate(prepared):
            if isinstance(obj, DataLoader):
                prepared[index] = self.prepare_data_loader(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                prepared[index] = self.prepare_optimizer(obj)
        for index, obj in enumerate(prepared):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                prepared[index] = self.prepare_scheduler(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """Parallelise one model (see :meth:`prepare`)."""
        _check_not_prepared(model)
        index = len(self._models)
        for name, param in model.named_parameters():
            self._plain_params[id(param)] = (weakref.ref(param), index, name)
        prepared = self._prepare_model(model)
        setattr(model, _PREPARED, True)
        setattr(prepared, _PREPARED, True)
        self._models.append(prepared)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        """Re-point ``optimizer`` at the prepared models' parameters and make it step only when gradients sync."""
        if getattr(optimizer, stepping.GATE_ATTRIBUTE, False):
            return optimizer
        stepping.check_parameters(optimizer, self._models, self._plain_param_ids())
        old = {key: (index, name) for key, (ref, index, name) in self._plain_params.items() if ref() is not None}
        stepping.repoint(optimizer, old, [_parameters_by_name(m) for m in self._models], drop_absent=self._pp)
        stepping.step_only_when_syncing(optimizer, ("step", "zero_grad"), lambda: self.sync_gradients)
        self._optimizers.append(optimizer)
        return optimizer

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Step ``scheduler`` only when gradients sync, once per data rank (Accelerate's rule; once when
        batches are split); every call when ``step_scheduler_with_optimizer=False``."""
        if self.step_scheduler_with_optimizer:
            steps = 1 if self.split_batches else self.mesh.size("dp")
            adjust = self.gradient_state.adjust_scheduler
            stepping.gate_scheduler(scheduler, lambda: self.sync_gradients, steps, adjust)
        self._schedulers.append(scheduler)
        return scheduler

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None, slice_fn_for_dispatch=None
    ):
        """Shard ``data_loader`` over the data ranks: Accelerate's semantics (dealing.py), or with
        ``use_seedable_sampler`` ndparallel's seeded DistributedSampler (data.py)."""
        if slice_fn_for_dispatch is not None:
            raise ConfigError("prepare_data_loader(slice_fn_for_dispatch=...): ndparallel never dispatches batches")
        config, ranks, rank = self._data_config, self.mesh.size("dp"), self.mesh.local_rank("dp")
        if config.use_seedable_sampler:
            loader = data.shard_loader(data_loader, ranks, rank, self.device, self.gradient_state,
                                       config.data_seed or 0, config.split_batches)  # fmt: skip
        else:
            loader = dealing.deal_loader(data_loader, ranks, rank, self.gradient_state, self.device, config,
                                         self.rng_types)  # fmt: skip
        self._dataloaders.append(loader)
        return loader

    def _plain_param_ids(self) -> set[int]:
        return {key for key, (ref, _, _) in self._plain_params.items() if ref() is not None}

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
        if self._sync_from_rank0:
            model = saving.take_rank0_weights(model, self.device)
        # Without FSDP the forward autocasts (below); FSDP casts through its policy.
        cfg = parallelize_config(self._config)
        model = parallelize(model.to(self.device), cfg, mesh=self.mesh, blocks=self._blocks(model))
        plain_dp = self.num_processes > 1 and self.mesh.size("dp_replicate") == self.num_processes  # Accelerate's DDP
        if plain_dp and getattr(self.ddp_handler, "broadcast_buffers", True):
            broadcast_buffers_each_forward(model, self.mesh["dp_replicate"].get_group())
        if self._autocast is not None:
            precision.wrap_autocast(model, self.device.type, self._autocast)
        family_for(model).on_prepared(model)  # a Hugging Face model's save_pretrained gathers its shards
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

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object (as Accelerate's): returns ``[None] * len(objects)`` to assign back."""
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._plain_params.clear()
        self.step = 0
        released: list[None] = [None] * len(objects)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return released

    clear = free_memory

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-batch: gradients sync (and ``sync_gradients`` is True) on every
        ``gradient_accumulation_steps``-th call, and on the last batch of a prepared loader."""
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step, self.sync_gradients = 0, True
        else:
            self.step += 1
            self.sync_gradients = self.step % state.num_steps == 0
        last = self.sync_gradients or state.sync_each_batch
        with contextlib.ExitStack() as stack:
            for model in models:  # the training step's rule: FSDP reduce-scatters each micro-batch
                if not isinstance(model, PipelineModel):  # pp: one call is one whole step (accumulation 1)
                    stack.enter_context(micro_batch_sync(model, last=last))
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

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Nothing to unscale: ndparallel runs no GradScaler (bf16, or fp16 under FSDP with fp32 gradients)."""

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Exact global gradient norm over every mesh the parameters live on (and every pipeline stage); clips
        in place."""
        pp_group = self.mesh["pp"].get_group() if self._pp else None
        return clip_grad_norm_(parameters, max_norm, norm_type, pp_group=pp_group)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]`` (element-wise: the same on every shard)."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """``torch.autocast`` to the mixed-precision dtype where FSDP does not cast (else a no-op)."""
        if autocast_handler is not None:
            check_fields(autocast_handler, AutocastKwargs.REFUSED)
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

    def end_training(self) -> None:
        """Finish the trackers and tear down the process group."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        destroy_distributed()

    # ------------------------------------------------------------------ weights
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The module prepare() returned, without the autocast forward (``keep_fp32_wrapper=False``, in place)
        or a ``torch.compile`` wrapper (``keep_torch_compile=False``). Parameters stay sharded."""
        if not keep_torch_compile:
            model = getattr(model, "_orig_mod", model)
        if not keep_fp32_wrapper:
            precision.unwrap_autocast(model)
        return model

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader``'s next pass without its first ``num_batches`` batches (resuming inside an epoch)."""
        return dealing.skip_first_batches(dataloader, num_batches)


def _parameters_by_name(model: nn.Module | PipelineModel) -> dict[str, list[nn.Parameter]]:
    """The prepared model's parameters under the names the unprepared one gave them: under pp a tied weight's
    copies all under the weight's name (the embedding's; the one-process model lists the one tensor once)."""
    named = model.one_process_parameters() if isinstance(model, PipelineModel) else model.named_parameters()
    by_name: dict[str, list[nn.Parameter]] = {}
    for name, param in named:
        by_name.setdefault(name, []).append(param)
    return by_name
