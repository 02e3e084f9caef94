"""``ndparallel.utils.memory``: ``accelerate.utils.memory`` under ndparallel's name."""

from ndparallel.accelerator.helpers import find_executable_batch_size, release_memory, should_reduce_batch_size
from ndparallel.utils import __getattr__  # noqa: F401 - Accelerate's names ndparallel refuses

__all__ = ["find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
