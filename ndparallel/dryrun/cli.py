"""``ndparallel dry-run``: the job at its real world size, in this process (docs/planning.md, "Dry run").

ndparallel dry-run --config job.yaml --world 1024
ndparallel dry-run --config job.yaml --world 64 --gpu-mem 80GiB --json
ndparallel dry-run --world 8 model.preset=8b data.seq_len=8192 train.global_batch=64 tp_size=8 dp_shard_size=-1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ndparallel.dryrun.report import format_report, format_table
from ndparallel.errors import ConfigError
from ndparallel.estimate.hardware import GPU_KINDS

__all__ = ["add_dry_run_parser", "add_plan_dry_run", "run_dry_run"]


def add_dry_run_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "dry-run",
        help="run the job's real mesh, parallelize and training step at its real world size, in one CPU process",
        description="Every rank that differs (each pipeline stage, uneven FSDP shards), one after another on "
        "torch's fake process group and fake tensors: per-rank peak memory and its parts, where the peak is, "
        "collectives per mesh dimension, FLOPs. The same ConfigError as the real job.",
    )
    p.add_argument("--config", help="the training YAML (ndparallel train's); default: its defaults")
    p.add_argument(
        "--model", help="a preset, a Hugging Face config.json or folder, or module:factory (default: the job's model)"
    )
    p.add_argument("--world", type=int, required=True, help="the job's world size (GPUs), up to 16,384")
    p.add_argument("--gpu-mem", help="memory per GPU (e.g. 80GiB): name the rank, phase and module that would OOM")
    p.add_argument(
        "--gpu", default="h100", choices=sorted(GPU_KINDS),
        help="the GPU kind whose roofline prices the traced ops (peak FLOP/s, HBM bandwidth; h100)",
    )  # fmt: skip
    p.add_argument(
        "--steps",
        type=int,
        default=1,
        help="training steps after the optimizer state is made; the last is measured (1)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--table", action="store_true", help="print the per-rank table only")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. model.preset=70b tp_size=8")
    p.set_defaults(func=run_dry_run)
    return p


def run_dry_run(args: argparse.Namespace) -> int:
    """0 when every rank fits (or no --gpu-mem), 1 when one would run out of memory; ConfigError: the caller's."""
    # Imported here, not with the parser: the engine's DTensor and training imports cost every ``ndparallel``
    # command (the ``train`` front process builds this parser too) ~0.5 CPU-s (docs/architecture.md, "Tests").
    from ndparallel.dryrun.run import dry_run
    from ndparallel.estimate import parse_bytes
    from ndparallel.train.job_config import TrainConfig

    cfg = TrainConfig.from_sources(args.config, args.overrides, os.environ, host_checks=False)
    memory = parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None
    report = dry_run(cfg, args.world, model=args.model, gpu_memory=memory, steps=args.steps, progress=_progress)
    report.gpu = args.gpu
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    elif args.table:
        print(format_table(report))
    else:
        print(format_report(report))
    return 1 if report.out_of_memory() else 0


def add_plan_dry_run(plan_parser: argparse.ArgumentParser) -> None:
    """``plan --dry-run [--dry-run-top K]``: after the ranking, dry-run the top K shapes, figures side by side."""
    group = plan_parser.add_argument_group("dry run (docs/planning.md, 'Dry run')")
    group.add_argument(
        "--dry-run", action="store_true",
        help="also run the top shapes' real mesh, parallelize and training step on fake ranks: figures side by side",
    )  # fmt: skip
    group.add_argument("--dry-run-top", type=int, default=3, help="how many of the top shapes to dry-run (3)")
    plan_only = plan_parser.get_default("func")
    plan_parser.set_defaults(func=lambda args: _plan(args) if args.dry_run else plan_only(args))


def _plan(args: argparse.Namespace) -> int:
    from ndparallel.dryrun.planner import format_side_by_side, plan_dry_runs
    from ndparallel.estimate.cli import format_plan, plan_from_args, plan_to_json

    try:
        if args.dry_run_top < 1:
            raise ConfigError(f"--dry-run-top={args.dry_run_top} must be >= 1")
        result = plan_from_args(args)
        sides = plan_dry_runs(result, args.dry_run_top, progress=_progress) if result.ranked else []
    except ConfigError as err:
        sys.stderr.write(f"ndparallel plan: error: {err}\n")
        return 2
    if args.json:
        data = plan_to_json(result, args.top, args.rejected)
        data["dry_run"] = [
            {"mesh": s.shape, "rank": s.rank.rank, "analytic": s.analytic, "dry_run": s.measured,
             "comm": {d: {"analytic": a, "dry_run": m} for d, (a, m) in s.comm.items()},
             "compute_s": {"analytic": s.compute_s[0], "trace": s.compute_s[1]},
             "step_s": {"analytic": s.step_s[0], "trace": s.step_s[1]}, "differs": s.disagreements()}
            for s in sides
        ]  # fmt: skip
        print(json.dumps(data, indent=2))
    else:
        print(format_plan(result, args.top, args.rejected))
        if sides:
            print("\n" + format_side_by_side(sides))
    return 0 if result.ranked else 1


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """``python -m ndparallel.dryrun.cli ...``, the same as ``ndparallel dry-run ...``."""
    parser = argparse.ArgumentParser(prog="ndparallel")
    add_dry_run_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        sys.stderr.write(f"ndparallel: error: {err}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
