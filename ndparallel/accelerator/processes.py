"""Which process am I, and code that runs on some processes only: Accelerate's ``PartialState`` names, shared by
the Accelerator (a mixin) and ``ndparallel.state.PartialState``."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.accelerator.operations import pad_across_processes, send_to_device
from ndparallel.errors import ConfigError

__all__ = ["ProcessNames", "PartialState"]


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    return None


class ProcessNames:
    """Process indices, barriers and per-process decorators over the default process group."""

    @property
    def process_index(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def num_processes(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.process_index))

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """More than one process."""
        return self.num_processes > 1

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only (as Accelerate's)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        if self.use_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """The main process runs the block first; the others enter it once it has left."""
        return self._first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        """The local main process runs the block first; the others enter it once it has left."""
        return self._first(self.is_local_main_process)

    def on_main_process(self, function: Callable) -> Callable:
        """``function`` on the main process, a function doing nothing elsewhere (a decorator)."""
        return function if self.is_main_process or not self.use_distributed else _do_nothing

    def on_local_main_process(self, function: Callable) -> Callable:
        return function if self.is_local_main_process or not self.use_distributed else _do_nothing

    def on_last_process(self, function: Callable) -> Callable:
        return function if self.is_last_process or not self.use_distributed else _do_nothing

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """``function`` on process ``process_index`` only (``@on_process(process_index=1)`` as a decorator)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return function if self.process_index == process_index or not self.use_distributed else _do_nothing

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        chosen = self.local_process_index == local_process_index
        return function if chosen or not self.use_distributed else _do_nothing

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of ``inputs`` (list, tuple, tensor, or a dict of them of one length):
        the first ``len % processes`` processes get one more. ``apply_padding`` repeats the last element so
        every share has the same length (then gather and drop the extra)."""
        if self.num_processes == 1:
            yield inputs
            return
        length = len(inputs)
        if isinstance(inputs, dict):
            lengths = {len(v) for v in inputs.values()}
            if len(lengths) > 1:
                raise ConfigError("split_between_processes: every value of the dict must have the same length")
            length = lengths.pop() if lengths else 0
        per, extra = divmod(length, self.num_processes)
        start = self.process_index * per + min(self.process_index, extra)
        end = start + per + (1 if self.process_index < extra else 0)
        yield self._share(inputs, start, end, per + (1 if extra else 0), apply_padding)

    def _share(self, inputs: Any, start: int, end: int, longest: int, pad: bool) -> Any:
        if isinstance(inputs, dict):
            return {k: self._share(v, start, end, longest, pad) for k, v in inputs.items()}
        if not isinstance(inputs, (list, tuple, torch.Tensor)):
            raise ConfigError(
                f"split_between_processes takes a list, tuple, tensor or dict of them, got {type(inputs).__name__}"
            )
        share = inputs[start:end]
        if not pad:
            return share
        if isinstance(share, torch.Tensor):
            device = getattr(self, "device", share.device)
            return pad_across_processes(send_to_device(share, device), pad_index=send_to_device(inputs[-1], device))
        missing = longest - len(share)
        return share + (type(share)([inputs[-1]]) * missing)


class PartialState(ProcessNames):
    """Accelerate's ``PartialState()``: the process group (started from torchrun's environment, or one process)
    and the names above, without an Accelerator."""

    def __init__(self, cpu: bool = False, **kwargs: Any):
        from ndparallel.distributed.process import init_distributed

        if kwargs:
            raise ConfigError(f"PartialState({', '.join(kwargs)}=...) is not supported by ndparallel: pass cpu= only")
        if not dist.is_initialized():
            from ndparallel.config.parallelism import ParallelismConfig

            device_type = "cpu" if cpu else os.environ.get("NDP_DEVICE") or None
            init_distributed(ParallelismConfig(dp_replicate_size=-1), device_type=device_type)
        self._cpu = cpu

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available() and not self._cpu:
            return torch.device("cuda", self.local_process_index % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def initialized(self) -> bool:
        return dist.is_initialized()

    @property
    def distributed_type(self) -> Any:
        from ndparallel.accelerator.state import distributed_type_of

        return distributed_type_of(self.num_processes, False, self.device.type)

    def destroy_process_group(self, group: Any = None) -> None:
        from ndparallel.distributed.process import destroy_distributed

        destroy_distributed()
