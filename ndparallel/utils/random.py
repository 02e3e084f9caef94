"""``ndparallel.utils.random``: ``accelerate.utils.random`` under ndparallel's name."""

from ndparallel.accelerator.misc import synchronize_rng_state, synchronize_rng_states
from ndparallel.accelerator.seed import set_seed
from ndparallel.utils import __getattr__  # noqa: F401 - Accelerate's names ndparallel refuses

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]
