"""Time of one kind of kernel on one GPU: a matmul by its shape, causal attention, a memory-bound pass.

Three constants, the same for every GPU kind (what differs, peak and bandwidth, is in ``hardware.GPU_KINDS``):

* ``GEMM_EFF``: the fraction of dense peak a large bf16 GEMM sustains (cuBLAS on Hopper / Ampere reaches
  0.75-0.8 of the data sheet on shapes of thousands);
* ``GEMM_OVERHEAD_S``: a fixed cost per GEMM (launch, the last partial wave of tiles, the epilogue), which is
  what makes a small GEMM's efficiency fall with its size: ``eff = GEMM_EFF x t / (t + overhead)`` (a 1024^3
  bf16 GEMM takes ~4-5 us on an H100: about half of peak);
* ``HBM_EFF``: the fraction of HBM bandwidth an elementwise or reduction kernel streams at (copy kernels reach
  85-90 %).
"""

from __future__ import annotations

__all__ = ["GEMM_EFF", "GEMM_OVERHEAD_S", "HBM_EFF", "attention_s", "gemm_efficiency", "matmul_s", "memory_s"]

GEMM_EFF = 0.80
GEMM_OVERHEAD_S = 2e-6
HBM_EFF = 0.85


def matmul_s(m: float, n: float, k: float, peak_flops: float, hbm_bw: float, dtype_bytes: int = 2) -> float:
    """One ``[m, k] @ [k, n]`` GEMM: ``2 m n k`` FLOPs at ``GEMM_EFF`` of peak, or its operands' bytes at
    ``HBM_EFF`` of bandwidth when that takes longer (skinny shapes), plus the fixed overhead."""
    if min(m, n, k) <= 0:
        return 0.0
    compute = 2 * m * n * k / (peak_flops * GEMM_EFF)
    memory = dtype_bytes * (m * k + k * n + m * n) / (hbm_bw * HBM_EFF)
    return max(compute, memory) + GEMM_OVERHEAD_S


def gemm_efficiency(m: float, n: float, k: float, peak_flops: float, hbm_bw: float) -> float:
    """Achieved fraction of peak of one GEMM (what ``matmul_s`` implies; for tables and tests)."""
    return 2 * m * n * k / (matmul_s(m, n, k, peak_flops, hbm_bw) * peak_flops)


def attention_s(flops: float, peak_flops: float, attention_eff: float) -> float:
    """Flash attention's executed FLOPs at the GPU kind's attention efficiency."""
    return flops / (peak_flops * attention_eff)


def memory_s(bytes_moved: float, hbm_bw: float) -> float:
    """A memory-bound kernel (or a sum of them): bytes read + written over ``HBM_EFF`` of HBM bandwidth."""
    return bytes_moved / (hbm_bw * HBM_EFF)
