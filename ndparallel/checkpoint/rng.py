"""Per-rank RNG states as tensors: torch CPU, CUDA (the current device), python ``random`` and numpy.

Saved under the DCP keys ``rng.rank<r>.<generator>``, so rank ``r`` of the job that loads gets
rank ``r``'s state back, and nothing is pickled: python's Mersenne-Twister state and numpy's are
written as integer tensors, their cached Gaussian as a float64 tensor.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["rng_prefix", "rng_states", "set_rng_states"]


def rng_prefix(rank: int) -> str:
    """The key prefix of rank ``rank``'s RNG tensors."""
    return f"rng.rank{rank}."


def rng_states(rank: int) -> dict[str, torch.Tensor]:
    """This rank's torch CPU, CUDA (current device), python ``random`` and numpy global RNG states."""
    prefix = rng_prefix(rank)
    out = {prefix + "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[prefix + "torch_cuda"] = torch.cuda.get_rng_state()
    version, mt, gauss = random.getstate()
    out[prefix + "python"] = torch.tensor([version, *mt], dtype=torch.int64)
    out[prefix + "python_gauss"] = torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64)
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out[prefix + "numpy"] = torch.tensor([pos, has_gauss, *keys.tolist()], dtype=torch.int64)
    out[prefix + "numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return out


def set_rng_states(loaded: dict[str, torch.Tensor], rank: int) -> None:
    """Set this process's generators from rank ``rank``'s tensors in ``loaded`` (as :func:`rng_states` made them)."""
    prefix = rng_prefix(rank)
    torch.set_rng_state(loaded[prefix + "torch_cpu"])
    if prefix + "torch_cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded[prefix + "torch_cuda"])
    py, py_gauss = loaded[prefix + "python"].tolist(), loaded[prefix + "python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), py_gauss[1] if py_gauss[0] else None))
    npy = loaded[prefix + "numpy"].tolist()
    keys = np.array(npy[2:], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, npy[0], npy[1], loaded[prefix + "numpy_gauss"].item()))
