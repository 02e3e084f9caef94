"""The per-GPU constants of the time model, in one table, each with its source; and the per-link constants.

Data-sheet numbers are the vendor's (dense, no sparsity). Efficiencies are what real kernels reach of those
numbers; where a GPU kind's efficiency differs (attention), it sits in the GPU's row. docs/planning.md
("Step time") has the table with its sources and how to add a GPU kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.distributed.peak import GPU_PEAK_BF16

__all__ = ["GPU_KINDS", "LINKS", "GpuKind", "Link"]

GiB = 1024**3


@dataclass(frozen=True)
class GpuKind:
    """One GPU kind: what the step-time model reads of it."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    hbm_bw: float
    """HBM bandwidth, bytes/s."""
    memory: float
    """Bytes of memory (nominal)."""
    nvlink_bw: float
    """NVLink bandwidth per GPU and direction, bytes/s."""
    network_bw: float
    """Network bandwidth per GPU and direction (one 400 Gb/s NIC per GPU), bytes/s."""
    attention_eff: float
    """Fraction of ``peak_flops`` FlashAttention-2 (torch SDPA's flash kernel) reaches, forward + backward,
    causal, head dim 128, long sequences."""
    source: str


_NIC_400G = 400e9 / 8
GPU_KINDS: dict[str, GpuKind] = {
    "h100": GpuKind(
        "h100", GPU_PEAK_BF16["H100"], 3.35e12, 80 * GiB, 450e9, _NIC_400G, 0.30,
        "NVIDIA H100 SXM5 data sheet (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s "
        "bidirectional); attention: torch SDPA's flash kernel (FlashAttention-2) forward 290-330 TFLOP/s on "
        "H100 SXM5, causal, head dim 128 (FlashAttention-3 paper, Shah et al. 2024, Fig. 5; pytorch/benchmark "
        "PR 2296), its backward slower: 0.30 of peak",
    ),
    "h100-hbm2e": GpuKind(
        "h100-hbm2e", 835e12, 2.4e12, 96 * GiB, 450e9, _NIC_400G, 0.30,
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton: 96 GB HBM2e, 2.4 TB/s, 500 W "
        "limit, 400 Gb/s per GPU); its peak is 'between SXM and NVL, exact value unknown': the lower bound, "
        "835 TFLOP/s (H100 NVL data sheet), since a 500 W limit holds dense-matmul clocks below the 700 W "
        "SXM part's; attention efficiency as h100",
    ),
    "h200": GpuKind(
        "h200", GPU_PEAK_BF16["H200"], 4.8e12, 140 * GiB, 450e9, _NIC_400G, 0.30,
        "NVIDIA H200 SXM data sheet (989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s "
        "bidirectional); attention: the H100 figure (same SMs and clocks)",
    ),
    "a100": GpuKind(
        "a100", GPU_PEAK_BF16["A100"], 2.039e12, 80 * GiB, 300e9, 200e9 / 8, 0.60,
        "NVIDIA A100 SXM4 80GB data sheet (312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s "
        "bidirectional, one 200 Gb/s HDR NIC per GPU); attention: FlashAttention-2 paper, ~190 TFLOP/s "
        "fwd+bwd on A100",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Link:
    """A link kind: a fixed cost per collective call plus bytes at a fraction of the link's bandwidth."""

    latency_s: float
    efficiency: float
    """Bus bandwidth NCCL's ring collectives reach of the link's data-sheet bandwidth, large messages."""
    source: str


LINKS: dict[str, Link] = {
    "intra": Link(10e-6, 0.80, "nccl-tests all_gather / reduce_scatter bus bandwidth on 8-GPU NVLink nodes, "
                  "~360 of 450 GB/s for messages of 100s of MB"),
    "inter": Link(30e-6, 0.80, "nccl-tests across nodes with one 400 Gb/s NIC per GPU, ~40 of 50 GB/s"),
}  # fmt: skip
