"""ndparallel: N-dimensional parallelism (data replicate and shard, tensor, context, pipeline, expert) for PyTorch.

Also 🤗 Accelerate's top-level names (``from accelerate import Accelerator, DistributedType`` changes its package
only); the few it does not provide import and raise a one-line ConfigError when used."""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from ndparallel.lazy import lazy_names
from ndparallel.parallel.protocol import load_builtin_families_with

__version__ = "0.1.0"

# Public name -> the module that defines it. Imported on first use (PEP 562), so that ``import ndparallel.launch``
# (the ``ndparallel`` command, each launched script's runner) does not pay for DTensor, FSDP and DCP it does not
# use: ~0.5 s of CPU per process (docs/architecture.md, "Tests").
_EXPORTS: dict[str, str] = {
    "Accelerator": "ndparallel.accelerator",
    "set_seed": "ndparallel.accelerator",
    "skip_first_batches": "ndparallel.accelerator.dealing",
    "DDPCommunicationHookType": "ndparallel.accelerator.enums",
    "DistributedType": "ndparallel.accelerator.enums",
    "find_executable_batch_size": "ndparallel.accelerator.helpers",
    "AutocastKwargs": "ndparallel.accelerator.kwargs",
    "DataLoaderConfiguration": "ndparallel.accelerator.kwargs",
    "DistributedDataParallelKwargs": "ndparallel.accelerator.kwargs",
    "GradScalerKwargs": "ndparallel.accelerator.kwargs",
    "InitProcessGroupKwargs": "ndparallel.accelerator.kwargs",
    "ProfileKwargs": "ndparallel.accelerator.kwargs",
    "synchronize_rng_states": "ndparallel.accelerator.misc",
    "FullyShardedDataParallelPlugin": "ndparallel.accelerator.options",
    "PartialState": "ndparallel.accelerator.processes",
    "ParallelismConfig": "ndparallel.config.parallelism",
    "Mesh": "ndparallel.distributed.mesh",
    "destroy_distributed": "ndparallel.distributed.process",
    "init_distributed": "ndparallel.distributed.process",
    "average_over": "ndparallel.distributed.reduce",
    "ConfigError": "ndparallel.errors",
    "notebook_launcher": "ndparallel.launch.notebook",
    "clip_grad_norm_": "ndparallel.parallel.clip",
    "context_parallel": "ndparallel.parallel.context_parallel",
    "no_sync": "ndparallel.parallel.grad_sync",
    "auxiliary_loss": "ndparallel.parallel.loss",
    "cross_entropy_loss": "ndparallel.parallel.loss",
    "parallelize": "ndparallel.parallel.parallelize",
}
_SUBPACKAGES = ("checkpoint", "models", "train")

# The built-in model families register when ndparallel.models.builtin is imported; the family lookup imports it at
# its first use, so that parallelize() on a Hugging Face model finds its family however parallelize was imported,
# and a job's config (ndparallel.models.TransformerConfig) reads without the families' DTensor imports.
load_builtin_families_with(functools.partial(importlib.import_module, "ndparallel.models.builtin"))

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel import checkpoint, models, train
    from ndparallel.accelerator import Accelerator, set_seed
    from ndparallel.accelerator.dealing import skip_first_batches
    from ndparallel.accelerator.enums import DDPCommunicationHookType, DistributedType
    from ndparallel.accelerator.helpers import find_executable_batch_size
    from ndparallel.accelerator.kwargs import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from ndparallel.accelerator.misc import synchronize_rng_states
    from ndparallel.accelerator.options import FullyShardedDataParallelPlugin
    from ndparallel.accelerator.processes import PartialState
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.distributed.mesh import Mesh
    from ndparallel.distributed.process import destroy_distributed, init_distributed
    from ndparallel.distributed.reduce import average_over
    from ndparallel.errors import ConfigError
    from ndparallel.launch.notebook import notebook_launcher
    from ndparallel.parallel.clip import clip_grad_norm_
    from ndparallel.parallel.context_parallel import context_parallel
    from ndparallel.parallel.grad_sync import no_sync
    from ndparallel.parallel.loss import auxiliary_loss, cross_entropy_loss
    from ndparallel.parallel.parallelize import parallelize


def _accelerate_only_name(name: str) -> Any:
    """Accelerate's top-level names that ndparallel does not export from a module: ``is_rich_available``, and the
    ones it refuses (importable; using one raises a ConfigError)."""
    if name == "is_rich_available":
        from ndparallel.accelerator.helpers import is_available

        return is_available("rich")
    from ndparallel.accelerator.refusals import TOP_LEVEL, refused

    if name not in TOP_LEVEL:
        raise AttributeError(f"module 'ndparallel' has no attribute {name!r}")
    return refused(name, TOP_LEVEL[name])


__getattr__, _lazy_dir = lazy_names(__name__, _EXPORTS, subpackages=_SUBPACKAGES, fallback=_accelerate_only_name)


def __dir__() -> list[str]:
    return sorted({*_lazy_dir(), "is_rich_available"})


__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "ConfigError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "PartialState",
    "ProfileKwargs",
    "Mesh",
    "ParallelismConfig",
    "auxiliary_loss",
    "average_over",
    "checkpoint",
    "clip_grad_norm_",
    "context_parallel",
    "cross_entropy_loss",
    "destroy_distributed",
    "find_executable_batch_size",
    "init_distributed",
    "is_rich_available",
    "models",
    "no_sync",
    "notebook_launcher",
    "parallelize",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_states",
    "train",
]
