"""pytest-benchmark suite: a few small mesh shapes on simulated gloo ranks.

    .venv/bin/python -m pytest tests/bench/test_bench_scaling.py --benchmark-only
    .venv/bin/python -m pytest tests/bench/test_bench_scaling.py --benchmark-json=bench.json

pytest-benchmark times the whole call (process start-up included); the per-step figures the harness
measures (median step time, tokens/s, peak memory, communication bytes, exposed communication) are
attached to each entry as ``extra_info``. Nothing is asserted about speed: performance is recorded,
not tested (docs/benchmarks.md). The full sweep is ``ndparallel bench --config benchmarks/scaling.yaml``.
"""

from __future__ import annotations

import pytest

from ndparallel.bench import BenchCase, run_cases
from ndparallel.distributed.peak import cpu_matmul_peak

SHAPES = {
    "single": {},
    "fsdp2": {"dp_shard_size": 2},
    "ddp2": {"dp_replicate_size": 2},
    "tp2": {"tp_size": 2},
}


@pytest.fixture(scope="module")
def peak_flops() -> float:
    return cpu_matmul_peak().flops


@pytest.mark.parametrize("label", list(SHAPES))
def test_tiny_step(benchmark, peak_flops, label):
    case = BenchCase("pytest", label, {"preset": "tiny"}, SHAPES[label], seq_len=64, global_batch=4, warmup=1, steps=3)
    [result] = benchmark.pedantic(run_cases, args=([case], peak_flops), kwargs={"verbose": False}, rounds=1)
    benchmark.extra_info.update(
        world_size=result.world_size,
        step_median_s=result.step_median_s,
        tokens_per_s=result.tokens_per_s,
        mfu=result.mfu,
        peak_memory_bytes=result.peak_memory_bytes,
        comm_bytes=result.comm_bytes,
        exposed_comm_s=result.exposed_comm_s,
    )
    assert result.step_median_s > 0
