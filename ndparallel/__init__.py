"""ndparallel: N-dimensional parallelism (data replicate, FSDP shard, tensor, context) for PyTorch."""

from ndparallel import models
from ndparallel.config import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.mesh import Mesh, destroy_distributed, init_distributed

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Mesh",
    "ParallelismConfig",
    "destroy_distributed",
    "init_distributed",
    "models",
]
