"""The cluster the planner reasons about: how many GPUs, their memory, peak and links (:class:`ClusterSpec`), filled
from the one table of per-GPU constants (estimate/hardware.py) with any field overridden."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ndparallel.distributed.peak import GPU_PEAK_BF16
from ndparallel.errors import ConfigError
from ndparallel.estimate.hardware import GPU_KINDS
from ndparallel.estimate.units import GiB

__all__ = ["GPU_PRESETS", "MAX_GPUS", "ClusterSpec"]

# The ClusterSpec fields of each GPU kind of the one table of per-GPU constants (estimate/hardware.py).
GPU_PRESETS: dict[str, dict[str, Any]] = {
    name: dict(
        gpu=name, gpu_memory=kind.memory, peak_flops=kind.peak_flops, hbm_bw=kind.hbm_bw,
        intra_node_bw=kind.nvlink_bw, inter_node_bw=kind.network_bw, attention_eff=kind.attention_eff,
    )
    for name, kind in GPU_KINDS.items()
}  # fmt: skip


MAX_GPUS = 2**20
"""The largest world size the planner takes (a million ranks, beyond any cluster built): its search is bounded
so that ``ndparallel plan`` answers in seconds."""


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs and their links. Defaults: an H100 SXM 8-GPU node, NVLink 450 GB/s, 50 GB/s of network per GPU
    (``from_gpu`` fills every field from the GPU table, estimate/hardware.py)."""

    num_gpus: int = 8
    gpus_per_node: int = 8
    gpu_memory: float = 80 * GiB
    """Bytes of memory per GPU."""
    intra_node_bw: float = 450e9
    """Bandwidth of one GPU inside a node (NVLink), bytes/s per direction (data sheet; collectives reach
    ``hardware.LINKS['intra'].efficiency`` of it)."""
    inter_node_bw: float = 50e9
    """Network bandwidth per GPU between nodes (InfiniBand / RoCE), bytes/s per direction (data sheet)."""
    peak_flops: float = GPU_PEAK_BF16["H100"]
    """Dense peak FLOP/s of one GPU in the compute dtype."""
    mfu: float | None = None
    """Override: every FLOP at ``peak x mfu`` and no memory-bound time (the old flat model). None (default):
    the kernel model (estimate/compute.py)."""
    hbm_bw: float = 3.35e12
    """HBM bandwidth, bytes/s (memory-bound kernels)."""
    attention_eff: float = 0.30
    """Fraction of peak flash attention reaches (hardware.GpuKind.attention_eff)."""
    gpu: str = "h100"
    """The GPU kind's name (for the report)."""
    memory_margin: float = 0.1
    """Fraction of GPU memory kept free for the CUDA context, allocator fragmentation and comm buffers."""

    def __post_init__(self) -> None:
        for key in ("num_gpus", "gpus_per_node"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        if self.num_gpus > MAX_GPUS:
            raise ConfigError(f"gpus={self.num_gpus} is more than the planner's maximum of {MAX_GPUS} (2**20) GPUs")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ConfigError(
                f"gpus={self.num_gpus} is not a multiple of gpus_per_node={self.gpus_per_node}: "
                f"use {self.num_gpus // self.gpus_per_node * self.gpus_per_node} or "
                f"{math.ceil(self.num_gpus / self.gpus_per_node) * self.gpus_per_node} GPUs, or set --gpus-per-node"
            )
        for key in ("gpu_memory", "intra_node_bw", "inter_node_bw", "peak_flops", "hbm_bw"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}={getattr(self, key)!r} must be positive")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ConfigError(f"mfu={self.mfu!r} must be in (0, 1], e.g. 0.5 (or omitted: the kernel model)")
        if not 0 < self.attention_eff <= 1:
            raise ConfigError(f"attention_eff={self.attention_eff!r} must be in (0, 1]")
        if not 0 <= self.memory_margin < 1:
            raise ConfigError(f"memory_margin={self.memory_margin!r} must be in [0, 1), e.g. 0.1")

    @property
    def usable_memory(self) -> float:
        return self.gpu_memory * (1 - self.memory_margin)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @classmethod
    def from_gpu(cls, gpu: str, **overrides: Any) -> ClusterSpec:
        """A GPU kind of the table (``h100``, ``h100-hbm2e``, ``h200``, ``a100``) with any field overridden."""
        key = gpu.lower()
        if key not in GPU_PRESETS:
            raise ConfigError(f"unknown gpu {gpu!r}; choose one of {sorted(GPU_PRESETS)} (or give each field)")
        return cls(**{**GPU_PRESETS[key], **overrides})
