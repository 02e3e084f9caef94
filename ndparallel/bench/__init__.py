"""Scaling benchmarks: run mesh shapes x model presets on N ranks, measure, report.

    from ndparallel.bench import BenchCase, run_cases
    [result] = run_cases([BenchCase("demo", "fsdp2", {"preset": "tiny"}, {"dp_shard_size": 2},
                                    seq_len=64, global_batch=4)], peak_flops=1e11)
    result.tokens_per_s, result.peak_memory_bytes, result.comm, result.exposed_comm_s

``ndparallel bench --config benchmarks/scaling.yaml`` is the command-line front end; method notes
and recorded numbers are in docs/benchmarks.md.
"""

from ndparallel.bench.case import BenchCase
from ndparallel.bench.cli import add_bench_parser
from ndparallel.bench.harness import run_cases
from ndparallel.bench.result import CaseResult
from ndparallel.bench.sweep import cases_from_config, load_cases

__all__ = ["BenchCase", "CaseResult", "add_bench_parser", "cases_from_config", "load_cases", "run_cases"]
