"""``ndparallel bench``: run a sweep of mesh shapes and model presets; print, save JSON, plot.

ndparallel bench --config benchmarks/scaling.yaml                  # simulated gloo ranks on this CPU
ndparallel bench --config benchmarks/scaling.yaml --sweep strong steps=3
ndparallel launch --nproc-per-node 8 -- bench --config my_gpu.yaml --device cuda   # real GPUs
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from ndparallel.config.sources import load_yaml_mapping, parse_overrides
from ndparallel.errors import ConfigError

__all__ = ["add_bench_parser", "apply_defaults_overrides"]


def apply_defaults_overrides(data: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["steps=3", "model.preset=tiny", "parallelism.mixed_precision=bf16"]`` into ``data["defaults"]``."""
    data = dict(data)
    defaults = dict(data.get("defaults") or {})
    for key, value in parse_overrides(overrides).items():
        head, _, rest = key.partition(".")
        if rest:
            section = defaults.get(head, {})
            if isinstance(section, str):  # model: small -> {preset: small}
                section = {"preset": section}
            defaults[head] = {**section, rest: value}
        else:
            defaults[head] = value
    data["defaults"] = defaults
    return data


def _cmd_bench(args: argparse.Namespace) -> int:
    from ndparallel.bench.harness import inside_launcher, run_cases
    from ndparallel.bench.report import plot, write_json
    from ndparallel.bench.sweep import cases_from_config
    from ndparallel.distributed.peak import Peak, device_peak

    if args.from_json:
        return _replot(args)
    data = apply_defaults_overrides(load_yaml_mapping(args.config), list(args.overrides))
    cases = cases_from_config(data, device=args.device)
    if args.sweep:
        names = sorted({c.sweep for c in cases})
        missing = sorted(set(args.sweep) - set(names))
        if missing:
            raise ConfigError(f"--sweep {missing} not in {args.config}; its sweeps are {names}")
        cases = [c for c in cases if c.sweep in args.sweep]
    if args.max_ranks:
        cases = [c for c in cases if c.world_size <= args.max_ranks]
    if args.no_twin:
        for case in cases:
            case.compute_twin = False
    if not cases:
        raise ConfigError("no bench cases left to run (check --sweep / --max-ranks)")
    rank0 = not inside_launcher() or os.environ.get("RANK", "0") == "0"
    device = cases[0].device
    precision = "bf16" if cases[0].parallelism.get("mixed_precision") == "bf16" else "fp32"
    # Only rank 0 reports, so only it measures (CPU ranks measuring at once would disturb each other).
    peak = device_peak(device, precision) if rank0 else Peak(float("nan"), "not measured on this rank")
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if rank0:
        print(f"ndparallel bench: {len(cases)} case(s) from {args.config} | peak {peak.flops / 1e12:.3g} TFLOP/s "
              f"per {'machine' if device == 'cpu' else 'device'} ({peak.source})", flush=True)  # fmt: skip
    if device == "cuda" and not inside_launcher() and rank0 and max(c.world_size for c in cases) > 1:
        print("note: without `ndparallel launch` multi-rank cases run as local processes over gloo; "
              "for NCCL numbers run: ndparallel launch --nproc-per-node N -- bench ...", flush=True)  # fmt: skip
    results = run_cases(cases, peak.flops, threads_per_rank=args.threads_per_rank)
    if not rank0 or not results:
        return 0
    print()
    print_tables(results)
    out = args.out
    start = {"load_average_start": load}
    path = write_json(os.path.join(out, "results.json"), results, peak, config=str(args.config), machine=start)
    print(f"\nwrote {path}")
    if not args.no_plot:
        files = plot(results, out)
        if files:
            print("wrote " + ", ".join(map(str, files)))
        else:
            print("(no plots: matplotlib is not installed; pip install 'ndparallel[plot]')")
    return 0


def print_tables(results) -> None:  # noqa: ANN001
    """The case table, the collectives table, and for MoE cases the router and all-to-all table."""
    from ndparallel.bench.report import format_comm_table, format_experts_table, format_table

    print(format_table(results))
    print()
    print(format_comm_table(results))
    experts = format_experts_table(results)
    if experts:
        print()
        print(experts)


def _replot(args: argparse.Namespace) -> int:
    """Print the tables of a saved results.json and redraw its plots into ``--out``."""
    from ndparallel.bench.report import plot, read_json

    _doc, results = read_json(args.from_json)
    print_tables(results)
    files = [] if args.no_plot else plot(results, args.out)
    if files:
        print("wrote " + ", ".join(map(str, files)))
    return 0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on the ``ndparallel`` parser."""
    p = subparsers.add_parser("bench", help="sweep mesh shapes and model presets: table, JSON, plots")
    p.add_argument("--config", default="benchmarks/scaling.yaml", help="bench YAML (default: %(default)s)")
    p.add_argument("--sweep", action="append", default=[], help="run only this sweep (repeatable)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="override every case's device")
    p.add_argument("--max-ranks", type=int, default=None, help="skip cases with more ranks than this")
    p.add_argument("--out", default="bench-results", help="folder for results.json and plots (default: %(default)s)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per simulated CPU rank (default 1)")
    p.add_argument("--no-twin", action="store_true", help="skip the compute-only twin (no exposed-comm figure)")
    p.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    p.add_argument("--from-json", default=None, help="run nothing: print and plot a saved results.json")
    p.add_argument("overrides", nargs="*", help="defaults overrides, e.g. steps=3 seq_len=64 model.preset=tiny")
    p.set_defaults(func=_cmd_bench)
    return p
