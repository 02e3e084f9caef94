"""``ndparallel.parallelism_config``: ``ParallelismConfig`` under the path of ``accelerate.parallelism_config``,
so that Accelerate's import changes only its package name."""

from ndparallel.config.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
