"""ndparallel: N-dimensional parallelism (data replicate, FSDP shard, tensor, context) for PyTorch."""

from ndparallel import checkpoint, models, train
from ndparallel.accelerator import Accelerator, set_seed
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

__all__ = [
    "Accelerator",
    "ConfigError",
    "Mesh",
    "ParallelismConfig",
    "auxiliary_loss",
    "average_over",
    "checkpoint",
    "clip_grad_norm_",
    "context_parallel",
    "cross_entropy_loss",
    "destroy_distributed",
    "init_distributed",
    "models",
    "no_sync",
    "notebook_launcher",
    "parallelize",
    "set_seed",
    "train",
]
