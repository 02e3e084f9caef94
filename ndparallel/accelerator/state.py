"""Accelerate's state objects on an ndparallel Accelerator: ``accelerator.gradient_state`` (accumulation and the
prepared loaders being iterated) and ``accelerator.state`` (what ``AcceleratorState()`` reports)."""

from __future__ import annotations

from typing import Any

from ndparallel.accelerator.enums import DistributedType
from ndparallel.errors import ConfigError

__all__ = ["AcceleratorState", "GradientState", "distributed_type_of"]


class GradientState:
    """Accumulation settings, the sync flag and the stack of prepared loaders being iterated (the innermost one
    says whether this is the last batch and how many samples its last round really holds)."""

    def __init__(
        self,
        num_steps: int = 1,
        adjust_scheduler: bool = True,
        sync_with_dataloader: bool = True,
        sync_each_batch: bool = False,
    ):
        self.num_steps = num_steps
        self.adjust_scheduler = adjust_scheduler
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_each_batch = sync_each_batch
        self.sync_gradients = True
        self._loaders: list[Any] = []

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "adjust_scheduler": self.adjust_scheduler,
            "sync_with_dataloader": self.sync_with_dataloader,
            "sync_each_batch": self.sync_each_batch,
        }

    def add_loader(self, loader: Any) -> None:
        self._loaders.append(loader)

    def remove_loader(self, loader: Any) -> None:
        if loader in self._loaders:
            self._loaders.remove(loader)

    @property
    def active_dataloader(self) -> Any:
        return self._loaders[-1] if self._loaders else None

    @property
    def dataloader_references(self) -> list[Any]:
        return [None, *self._loaders]

    @property
    def in_dataloader(self) -> bool:
        return bool(self._loaders)

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self._loaders) and bool(self._loaders[-1].end_of_dataloader)

    @property
    def remainder(self) -> int:
        return self._loaders[-1].remainder if self._loaders else -1

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n"
        )


def distributed_type_of(world: int, fsdp: bool, device_type: str) -> DistributedType:
    """Accelerate's name for what the mesh does: NO (one process), FSDP (parameters sharded), else plain data
    parallel on CPU or GPU processes."""
    if world == 1:
        return DistributedType.NO
    if fsdp:
        return DistributedType.FSDP
    return DistributedType.MULTI_GPU if device_type == "cuda" else DistributedType.MULTI_CPU


class AcceleratorState:
    """What Accelerate's ``AcceleratorState`` tells about this job, read from an ndparallel Accelerator."""

    def __init__(self, accelerator: Any):
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        if name in _FROM_ACCELERATOR:
            return getattr(self._accelerator, name)
        if name in _NONE:
            return None
        raise AttributeError(name)

    @property
    def initialized(self) -> bool:
        return True

    @property
    def backend(self) -> str:
        import torch.distributed as dist

        return dist.get_backend()

    @property
    def fsdp_plugin(self) -> Any:
        return self._accelerator._fsdp_plugin

    @property
    def is_fsdp2(self) -> bool:
        return self._accelerator.is_fsdp2

    @property
    def use_ipex(self) -> bool:
        return False

    @property
    def dynamo_plugin(self) -> Any:
        return None

    def __repr__(self) -> str:
        acc = self._accelerator
        return (
            f"Distributed environment: {acc.distributed_type}\nNum processes: {acc.num_processes}\n"
            f"Process index: {acc.process_index}\nLocal process index: {acc.local_process_index}\n"
            f"Device: {acc.device}\nMixed precision type: {acc.mixed_precision}\n"
        )

    def _reset_state(self, reset_partial_state: bool = False) -> None:
        raise ConfigError(
            "AcceleratorState._reset_state: ndparallel's state lives on its Accelerator; make a new Accelerator "
            "after accelerator.end_training() instead"
        )


_FROM_ACCELERATOR = frozenset(
    {
        "device", "distributed_type", "num_processes", "process_index", "local_process_index", "is_main_process",
        "is_local_main_process", "is_last_process", "mixed_precision", "parallelism_config", "torch_device_mesh",
        "use_distributed", "split_between_processes", "main_process_first", "local_main_process_first",
        "wait_for_everyone", "print", "on_main_process", "on_local_main_process", "on_last_process", "on_process",
        "on_local_process",
    }
)  # fmt: skip
_NONE = frozenset(
    {"deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin", "torch_tp_plugin", "fp8_recipe_handler"}
)
