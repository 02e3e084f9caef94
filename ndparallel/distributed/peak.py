"""Peak FLOP/s to compute MFU against: a table for GPUs, a one-off matmul measurement for CPUs.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s, where model FLOPs are
``TransformerConfig.flops_per_token(seq) x tokens`` (6 x matmul parameters + causal attention per
token, forward + backward; recomputation is not counted, as usual).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

__all__ = ["GPU_PEAK_BF16", "Peak", "cpu_matmul_peak", "device_peak"]

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, from the vendors' data sheets (SXM parts). The one
# GPU peak table: the trainer's and the bench's MFU and `ndparallel plan`'s GPU presets all read it.
GPU_PEAK_BF16: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "V100": 125e12,
}


@dataclass(frozen=True)
class Peak:
    flops: float
    """Peak FLOP/s of one device (one GPU, or the whole CPU machine)."""
    source: str
    """How it was obtained, for the report."""


def cpu_matmul_peak(size: int = 512, seconds: float = 0.2, dtype: torch.dtype = torch.float32) -> Peak:
    """Machine peak: the best single-thread FLOP/s of a square ``size`` matmul, times the core count.

    One thread and the *best* of many short runs: on a machine shared with other work, the fastest
    run is the one that had a core to itself, so this estimates what each core can do rather than
    what was left over at the moment of measuring. It is a measured, achievable dense-matmul rate
    (not a data-sheet number) and the honest denominator for CPU MFU; the ranks of a simulated job
    share these cores.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        deadline = time.perf_counter() + seconds
        runs = 0
        while runs < 30 or time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
            runs += 1
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    per_core = 2 * size**3 / best
    name = str(dtype).removeprefix("torch.")
    return Peak(
        per_core * cores,
        f"measured: best 1-thread {size}x{size} {name} matmul {per_core / 1e9:.0f} GFLOP/s x {cores} cores",
    )


def device_peak(device_type: str, dtype: str = "fp32") -> Peak:
    """Peak of one device: the data-sheet bf16 figure for known GPUs, a measurement for CPUs."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for key, flops in GPU_PEAK_BF16.items():
            if key in name:
                return Peak(flops, f"{key} dense bf16 data sheet ({name})")
        return Peak(float("nan"), f"unknown GPU {name!r}: add it to ndparallel.distributed.peak.GPU_PEAK_BF16")
    return cpu_matmul_peak(dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
