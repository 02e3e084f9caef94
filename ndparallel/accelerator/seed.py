"""``set_seed``: Accelerate's helper of the same name, for ``random``, NumPy and torch (CPU and CUDA)."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["set_seed"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, NumPy and torch on this process. ``device_specific`` adds the global rank (different
    streams per rank); ``deterministic`` turns on ``torch.use_deterministic_algorithms``."""
    if device_specific and dist.is_initialized():
        seed += dist.get_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)
