"""ndparallel: N-dimensional parallelism (data replicate, FSDP shard, tensor, context) for PyTorch."""

from ndparallel import checkpoint, models, train
from ndparallel.clip import clip_grad_norm_
from ndparallel.config import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.grad_sync import no_sync
from ndparallel.mesh import Mesh, destroy_distributed, init_distributed
from ndparallel.metrics import average_over, cross_entropy_loss
from ndparallel.notebook import notebook_launcher
from ndparallel.parallelize import parallelize
from ndparallel.plans.context_parallel import context_parallel
from ndparallel.train.accelerator import Accelerator, set_seed

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "ConfigError",
    "Mesh",
    "ParallelismConfig",
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
