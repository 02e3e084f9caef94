"""Scaling benchmarks: run mesh shapes x model presets on N ranks, measure, report.

    from ndparallel.bench import BenchCase, run_cases
    [result] = run_cases([BenchCase("demo", "fsdp2", {"preset": "tiny"}, {"dp_shard_size": 2},
                                    seq_len=64, global_batch=4)], peak_flops=1e11)
    result.tokens_per_s, result.peak_memory_bytes, result.comm, result.exposed_comm_s

``ndparallel bench --config benchmarks/scaling.yaml`` is the command-line front end; method notes
and recorded numbers are in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ndparallel.lazy import lazy_names

# Public name -> its module, imported on first use (PEP 562): the ``ndparallel`` command builds the bench parser
# (``cli``) without the harness's DTensor and model imports.
_EXPORTS: dict[str, str] = {
    "BenchCase": "ndparallel.bench.case",
    "add_bench_parser": "ndparallel.bench.cli",
    "run_cases": "ndparallel.bench.harness",
    "CaseResult": "ndparallel.bench.result",
    "cases_from_config": "ndparallel.bench.sweep",
    "load_cases": "ndparallel.bench.sweep",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.bench.case import BenchCase
    from ndparallel.bench.cli import add_bench_parser
    from ndparallel.bench.harness import run_cases
    from ndparallel.bench.result import CaseResult
    from ndparallel.bench.sweep import cases_from_config, load_cases


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


__all__ = ["BenchCase", "CaseResult", "add_bench_parser", "cases_from_config", "load_cases", "run_cases"]
