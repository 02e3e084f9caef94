"""The accelerator a ``transformers.Trainer`` gets from :class:`~ndparallel.accelerator.trainer.NDParallelTrainerMixin`:
ndparallel's :class:`~ndparallel.accelerator.core.Accelerator` plus the Accelerate attributes the Trainer (and TRL)
read. Gathers follow ndparallel's mesh: metrics over ``dp`` (tp/cp ranks share a batch), and over ``dp_cp`` for the
per-rank sums a loss computation hands over while :meth:`TrainerAccelerator.shares_of_the_batch` is on (under cp
each rank holds a share of every sequence). docs/accelerate-migration.md#the-transformers-trainer.
"""

from __future__ import annotations

import atexit
import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.accelerator.core import Accelerator
from ndparallel.accelerator.precision import wrap_autocast
from ndparallel.config.parallelism import ParallelismConfig

__all__ = ["TrainerAccelerator", "rebuilt"]


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


_EXIT_TEARDOWN = []  # registered once per process


def _tear_down_at_exit() -> None:
    """The Trainer's process group is started by transformers (Accelerate's ``PartialState``) before ndparallel
    sees it, so ``init_distributed`` does not register its exit teardown: without it a rank may destroy its gloo
    group while a peer still finishes the last collective, and that peer aborts after the script's last line
    ("terminate called without an active exception", seen under load). Register ndparallel's own, once."""
    if _EXIT_TEARDOWN or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from ndparallel.distributed.process import _destroy_at_exit  # the package's one exit teardown, reused

    atexit.register(_destroy_at_exit)
    _EXIT_TEARDOWN.append(True)


class TrainerAccelerator:
    """ndparallel's :class:`Accelerator` with the Accelerate attributes the Trainer reads; the rest delegates."""

    def __init__(self, accelerator: Accelerator, autocast: torch.dtype | None = None):
        from accelerate.utils import DistributedType  # the Trainer compares with Accelerate's enum

        _tear_down_at_exit()
        self._accelerator = accelerator
        self._autocast = autocast  # the forward's autocast dtype (the Trainer's bf16=True), or None
        self.gradient_state = _GradientState(accelerator)
        self.state = types.SimpleNamespace(fsdp_plugin=None, deepspeed_plugin=None)  # neither: ndparallel shards
        self.scaler = None  # bf16 needs none; fp16 is refused without FSDP, unscaled with it (docs/mixed-precision)
        self.optimizer_step_was_skipped = False
        self.distributed_type = DistributedType.MULTI_GPU if accelerator.num_processes > 1 else DistributedType.NO
        self.parallelism_config = _TrainerParallelismConfig(accelerator.parallelism_config)
        self._shares = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    @property
    def sync_gradients(self) -> bool:
        return self._accelerator.sync_gradients

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward``; under pp a no-op: the model call ran the pipeline schedule, backward included
        (``trainer_pipeline.py``), and the Trainer only scales the loss it logs."""
        if self._accelerator.parallelism_config.pp_size > 1:
            return
        self._accelerator.backward(loss, **kwargs)

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager:
        """Accelerate's ``no_sync``; under pp nothing to defer: each model call is a whole pipeline step, which
        reduces its own gradients (the Trainer's micro-batches add up, ``trainer_pipeline.py``)."""
        if self._accelerator.parallelism_config.pp_size > 1:
            return contextlib.nullcontext()
        return self._accelerator.no_sync(model)

    def prepare(self, *objects: Any) -> Any:
        """``Accelerator.prepare`` of what is not prepared yet: the Trainer prepares again after ``evaluate()``
        or in a second ``train()``; what was prepared is returned as it is."""
        done = [obj if _is_prepared(obj) else None for obj in objects]
        todo = [obj for obj, kept in zip(objects, done, strict=True) if kept is None]
        fresh = iter(_as_tuple(self._accelerator.prepare(*todo)) if todo else ())
        out = [kept if kept is not None else self._autocast_forward(next(fresh)) for kept in done]
        return out[0] if len(out) == 1 else tuple(out)

    def _autocast_forward(self, obj: Any) -> Any:
        """A prepared model (each pipeline stage under pp) running its forward under ``torch.autocast``, as
        Accelerate runs one process's ``bf16=True``: parameters, gradients and their reduction stay fp32."""
        if self._autocast is None:
            return obj
        from ndparallel.accelerator.pipeline import PipelineModel

        modules = obj.stages if isinstance(obj, PipelineModel) else [obj] if isinstance(obj, torch.nn.Module) else []
        for module in modules:
            wrap_autocast(module, self._accelerator.device.type, self._autocast)
        return obj

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
        """Over ``dp`` (each sample once: tp/cp ranks share a batch; see :meth:`shares_of_the_batch`); 0-dim tensors
        as one element each; tuples, lists and dicts (a model's extra outputs) element by element, as Accelerate's."""
        if isinstance(data, (tuple, list)):
            return rebuilt(data, [self.gather_for_metrics(d, use_gather_object) for d in data])
        if isinstance(data, dict):
            return type(data)({k: self.gather_for_metrics(v, use_gather_object) for k, v in data.items()})
        if not isinstance(data, torch.Tensor):
            return data
        dim = "dp_cp" if self._shares and data.dim() == 0 else "dp"
        return _all_gather(data, self._accelerator.mesh[dim].get_group())

    @contextlib.contextmanager
    def shares_of_the_batch(self) -> Iterator[None]:
        """Inside: a 0-dim tensor gathered for metrics is this rank's share of a batch sum (TRL's token counts,
        entropy and accuracy sums under cp, where each rank holds a shard of every sequence), gathered over
        ``dp_cp`` so that each token counts once."""
        self._shares = True
        try:
            yield
        finally:
            self._shares = False

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad ``tensor`` along ``dim`` to the longest over the world (Accelerate's contract; nested alike)."""
        if isinstance(tensor, (tuple, list)):
            return rebuilt(tensor, [self.pad_across_processes(t, dim, pad_index, pad_first) for t in tensor])
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


def rebuilt(sequence: tuple | list, items: list) -> tuple | list:
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
