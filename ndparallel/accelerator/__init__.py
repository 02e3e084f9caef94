"""``ndparallel.Accelerator``: 🤗 Accelerate's API for hand-written loops, on the ndparallel mesh.

One concept per module: ``core`` (the Accelerator), ``options`` (Accelerate's constructor options and
FSDP plugin), ``precision`` (autocast where FSDP does not cast), ``data`` (loader sharding, skipping),
``stepping`` (optimizers and schedulers that step only when gradients sync), ``saving`` (full weights),
``trackers`` (JSONL, TensorBoard) and ``seed``. An Accelerate script changes its imports::

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.accelerator import FullyShardedDataParallelPlugin, set_seed
"""

from ndparallel.accelerator.core import Accelerator
from ndparallel.accelerator.dealing import skip_first_batches
from ndparallel.accelerator.options import FullyShardedDataParallelPlugin
from ndparallel.accelerator.seed import set_seed

__all__ = ["Accelerator", "FullyShardedDataParallelPlugin", "set_seed", "skip_first_batches"]
