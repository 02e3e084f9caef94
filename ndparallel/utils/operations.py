"""``ndparallel.utils.operations``: ``accelerate.utils.operations`` under ndparallel's name."""

from ndparallel.accelerator.operations import *  # noqa: F403
from ndparallel.accelerator.operations import __all__  # noqa: F401
from ndparallel.utils import __getattr__  # noqa: F401 - Accelerate's names ndparallel refuses
