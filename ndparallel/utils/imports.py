"""``ndparallel.utils.imports``: ``accelerate.utils.imports`` under ndparallel's name (the ``is_*_available``
checks)."""

import importlib.util

from ndparallel.accelerator.helpers import AVAILABILITY
from ndparallel.utils import __getattr__  # noqa: F401 - Accelerate's names ndparallel refuses

for _name, _check in AVAILABILITY.items():
    globals()[f"is_{_name}_available"] = _check


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    return True  # a dependency of ndparallel


def is_tqdm_available() -> bool:
    return importlib.util.find_spec("tqdm") is not None


def is_torch_distributed_available() -> bool:
    import torch.distributed

    return torch.distributed.is_available()
