"""``ndparallel.utils``: the names of ``accelerate.utils`` that ndparallel provides, under Accelerate's path, so
that ``from accelerate.utils import FullyShardedDataParallelPlugin, set_seed`` changes only its package name.

Accelerate's other plugins (DeepSpeed, Megatron-LM, ``TorchTensorParallelPlugin``...) have no twin here: their
``Accelerator(...)`` keywords are refused by name with the ndparallel setting to use (docs/accelerate-migration.md).
"""

from ndparallel.accelerator import FullyShardedDataParallelPlugin, set_seed

__all__ = ["FullyShardedDataParallelPlugin", "set_seed"]
