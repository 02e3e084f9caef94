"""An Accelerate-style object for users' own training loops, built on the ndparallel mesh.

Users of 🤗 Accelerate know the shape::

    acc = ndp.Accelerator(ndp.ParallelismConfig(dp_shard_size=-1, tp_size=2), gradient_accumulation_steps=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for tokens, labels in loader:
        with acc.accumulate(model):
            loss = ndp.cross_entropy_loss(model(tokens.to(acc.device)), labels.to(acc.device))
            acc.backward(loss)
        if acc.sync_gradients:  # the optimizer is yours: step it once per accumulated batch
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    acc.save_state("ckpt/step-100")

The difference from Accelerate is where collectives run: data is split over the ``dp`` view
(ranks of one tensor/context-parallel group get the same batch), metrics are gathered over
``dp`` and reduced over ``dp_cp``, and gradient clipping is exact across meshes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ndparallel import checkpoint
from ndparallel.clip import clip_grad_norm_
from ndparallel.config import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.grad_sync import no_sync
from ndparallel.mesh import Mesh, init_distributed
from ndparallel.parallelize import parallelize

__all__ = ["Accelerator"]


class Accelerator:
    """Mesh, device, gradient accumulation and checkpoint state for a hand-written loop."""

    def __init__(
        self,
        parallelism: ParallelismConfig | None = None,
        *,
        gradient_accumulation_steps: int = 1,
        device_type: str | None = None,
        mesh: Mesh | None = None,
    ):
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ConfigError(f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be an integer >= 1")
        self.mesh = mesh or init_distributed(parallelism, device_type=device_type)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.step = 0  # micro-batches seen inside accumulate()
        self.sync_gradients = True
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []

    # ------------------------------------------------------------------ where am I
    @property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    @property
    def process_index(self) -> int:
        return dist.get_rank()

    @property
    def num_processes(self) -> int:
        return dist.get_world_size()

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        dist.barrier()

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any) -> Any:
        """Parallelise models, re-point optimizers at the new parameters, shard data loaders over ``dp``.

        Returns the objects in the same order (one object: that object). Models are parallelised
        in place (FSDP2 and TP replace parameters by DTensors), so an optimizer built before
        ``prepare`` is re-pointed at the new parameters by name.
        """
        models = [o for o in objects if isinstance(o, nn.Module)]
        names_before = {id(p): (i, n) for i, m in enumerate(models) for n, p in m.named_parameters()}
        prepared, prepared_models = [], []
        for obj in objects:
            if isinstance(obj, nn.Module):
                obj = parallelize(obj.to(self.device), self.mesh.config, mesh=self.mesh)
                prepared_models.append(obj)
            elif isinstance(obj, DataLoader):
                obj = self._shard_loader(obj)
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                self._schedulers.append(obj)
            prepared.append(obj)
        params_after = [dict(m.named_parameters()) for m in prepared_models]
        for obj in prepared:
            if isinstance(obj, torch.optim.Optimizer):
                _repoint(obj, names_before, params_after)
                self._optimizers.append(obj)
        self._models.extend(prepared_models)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _shard_loader(self, loader: DataLoader) -> DataLoader:
        if isinstance(loader.sampler, DistributedSampler) or loader.batch_size is None:
            raise ConfigError(
                "prepare() shards a DataLoader built with batch_size= and no DistributedSampler; "
                "shard your own loader by accelerator.mesh.local_rank('dp') instead"
            )
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=self.mesh.size("dp"),
            rank=self.mesh.local_rank("dp"),
            shuffle=not isinstance(loader.sampler, torch.utils.data.SequentialSampler),
            drop_last=True,
        )
        options = {}
        if loader.num_workers > 0:
            options = dict(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
        return _EpochLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
            **options,
        )

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """One micro-batch: gradients sync (and ``sync_gradients`` is True) on every
        ``gradient_accumulation_steps``-th call only."""
        self.step += 1
        self.sync_gradients = self.step % self.gradient_accumulation_steps == 0
        context = contextlib.nullcontext() if self.sync_gradients else no_sync(model)
        with context:
            yield

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return no_sync(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with the loss divided by the accumulation steps."""
        (loss / self.gradient_accumulation_steps).backward(**kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Exact global gradient norm over every mesh the parameters live on; clips in place."""
        return clip_grad_norm_(parameters, max_norm, norm_type)

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

    def reduce(self, tensor: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Sum or mean of ``tensor`` over ``dp_cp`` (every rank that saw different tokens)."""
        if reduction not in ("mean", "sum"):
            raise ConfigError(f"reduction={reduction!r} must be 'mean' or 'sum'")
        group = self.mesh["dp_cp"].get_group()
        result = tensor.detach().clone()
        dist.all_reduce(result, group=group)
        return result / dist.get_world_size(group) if reduction == "mean" else result

    # ------------------------------------------------------------------ state
    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The module without a ``torch.compile`` wrapper (parallelize keeps the module itself)."""
        return getattr(model, "_orig_mod", model)

    def save_state(self, path: str, **state: Any) -> str:
        """Checkpoint the prepared model, optimizer and schedulers (DCP; loadable on any mesh)."""
        model, optimizer = self._single_model_and_optimizer()
        if self._schedulers:
            state["schedulers"] = [s.state_dict() for s in self._schedulers]
        return checkpoint.save(path, model, optimizer, accelerator_step=self.step, **state)

    def load_state(self, path: str) -> dict[str, Any]:
        """Restore what ``save_state`` wrote; returns the extra state."""
        model, optimizer = self._single_model_and_optimizer()
        state = checkpoint.load(path, model, optimizer)
        for scheduler, saved in zip(self._schedulers, state.pop("schedulers", []), strict=False):
            scheduler.load_state_dict(saved)
        self.step = int(state.pop("accelerator_step", 0))
        return state

    def _single_model_and_optimizer(self) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if len(self._models) != 1 or len(self._optimizers) > 1:
            raise ConfigError(
                f"save_state/load_state handle one prepared model and at most one optimizer, got "
                f"{len(self._models)} and {len(self._optimizers)}; call ndparallel.checkpoint.save per model"
            )
        return self._models[0], (self._optimizers[0] if self._optimizers else None)

    def end_training(self) -> None:
        from ndparallel.mesh import destroy_distributed

        destroy_distributed()


class _EpochLoader(DataLoader):
    """A DataLoader over a DistributedSampler that advances the sampler's epoch on every pass,
    so shuffling differs between epochs (the same on every rank)."""

    _epoch = 0

    def __iter__(self):
        self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        return super().__iter__()


def _repoint(optimizer: torch.optim.Optimizer, old: dict[int, tuple[int, str]], new: list[dict[str, Any]]) -> None:
    """Replace the optimizer's parameters (pre-parallelize objects) by the model's current ones, by name."""
    if optimizer.state:
        raise ConfigError("prepare() the optimizer before its first step (it already holds state)")
    for group in optimizer.param_groups:
        replaced = []
        for param in group["params"]:
            if id(param) in old:
                model_index, name = old[id(param)]
                replaced.append(new[model_index][name])
            else:
                replaced.append(param)
        group["params"] = replaced
