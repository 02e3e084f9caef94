"""ndparallel: N-dimensional parallelism (data replicate, FSDP shard, tensor, context) for PyTorch.

Also 🤗 Accelerate's top-level names (``from accelerate import Accelerator, DistributedType`` changes its package
only); the few it does not provide import and raise a one-line ConfigError when used."""

from typing import Any

from ndparallel import checkpoint, models, train
from ndparallel.accelerator import Accelerator, set_seed
from ndparallel.accelerator.dealing import skip_first_batches
from ndparallel.accelerator.enums import DDPCommunicationHookType, DistributedType
from ndparallel.accelerator.helpers import find_executable_batch_size, is_available
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
from ndparallel.accelerator.refusals import TOP_LEVEL as _REFUSED
from ndparallel.accelerator.refusals import refused as _refused
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

__version__ = "0.1.0"
is_rich_available = is_available("rich")


def __getattr__(name: str) -> Any:
    """Accelerate's top-level names ndparallel refuses: importable, raising a ConfigError when used."""
    if name in _REFUSED:
        return _refused(name, _REFUSED[name])
    raise AttributeError(f"module 'ndparallel' has no attribute {name!r}")


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
