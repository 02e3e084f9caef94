"""``ndparallel.utils.dataclasses``: ``accelerate.utils.dataclasses`` under ndparallel's name (configuration
dataclasses, kwargs handlers, enums, the FSDP plugin)."""

from ndparallel.accelerator.enums import *  # noqa: F403
from ndparallel.accelerator.enums import __all__ as _enums
from ndparallel.accelerator.kwargs import *  # noqa: F403
from ndparallel.accelerator.kwargs import __all__ as _kwargs
from ndparallel.accelerator.options import FullyShardedDataParallelPlugin
from ndparallel.utils import __getattr__  # noqa: F401 - Accelerate's names ndparallel refuses

__all__ = [*_enums, *(n for n in _kwargs if n != "check_fields"), "FullyShardedDataParallelPlugin"]
