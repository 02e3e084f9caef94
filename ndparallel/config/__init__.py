"""What a user declares, and every rule checkable on it alone: no ranks, no model (docs/architecture.md).

``parallelism`` (:class:`ParallelismConfig`: sizes, knobs, validation), ``dims`` (the mesh dims),
``sources`` (the unique-key YAML loader, overrides, field coercion), ``accelerate`` (🤗 Accelerate's key
names), ``pipeline`` (schedules, stages, micro-batches), ``sequence`` (which sequence lengths a mesh
splits), ``precision`` (who casts what) and ``preflight`` (the one job pre-flight that ``ndparallel
train``, ``bench`` and ``plan`` share) and ``paths`` (the one check that a folder a job writes to is writable).
"""

from ndparallel.config.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
