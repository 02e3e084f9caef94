"""``ndparallel.utils.constants``: ``accelerate.utils.constants`` under ndparallel's name."""

from ndparallel.accelerator.constants import *  # noqa: F403
from ndparallel.accelerator.constants import __all__  # noqa: F401
