"""The ``ndparallel`` command: ``mesh``, ``train``, ``launch``, ``plan``, ``bench``, ``verify``, ``dry-run``.

``launch`` is a thin layer over ``torch.distributed.run`` (torchrun): every torchrun option
(``--nnodes``, ``--rdzv-endpoint``, ``--max-restarts``, ...) works unchanged, and ``--cpu-ranks N``
adds the defaults for simulating N gloo ranks on one CPU machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ndparallel.config.parallelism import CPU_RANKS_ENV, ParallelismConfig
from ndparallel.config.sources import load_yaml_mapping
from ndparallel.errors import EXIT_INTERRUPTED, CheckpointError, ConfigError, DivergenceError, JobError
from ndparallel.launch.torchrun import cpu_ranks, launch, without_option
from ndparallel.launch.torchrun import torchrun_argv as _torchrun_argv  # noqa: F401  (tests and users import it here)

__all__ = ["main"]


def _cmd_mesh(args: argparse.Namespace) -> int:
    from ndparallel.distributed.mesh import format_rank_table

    cfg = ParallelismConfig.from_sources(load_yaml_mapping(args.config), os.environ, args.overrides)
    world = args.world_size
    if world is None:
        if -1 in cfg.sizes.values():
            raise ConfigError(f"{args.config} has a size of -1: pass --world-size N to resolve it")
        world = cfg.world_size
    print(format_rank_table(cfg.resolve(world)))
    return 0


def _inside_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def _cmd_train(args: argparse.Namespace) -> int:
    from ndparallel.distributed.process import check_device_type
    from ndparallel.train.job_config import job_device, refuse_cuda_on_cpu_ranks

    ranks = None if args.cpu_ranks is None else cpu_ranks(args.cpu_ranks)
    if ranks is not None:  # before the config's memory checks, which count this machine's ranks (said "1 rank(s)")
        os.environ[CPU_RANKS_ENV] = str(ranks)
    cfg = _train_config(args)
    # An unknown device, or cuda without CUDA, is refused here, before any rank starts (a bad
    # NDP_DEVICE even where --cpu-ranks overrides it).
    for requested, source in ((os.environ.get("NDP_DEVICE"), "NDP_DEVICE"), (args.device, "--device")):
        if requested:
            check_device_type(requested, source)
    if ranks is not None:
        refuse_cuda_on_cpu_ranks(args.device, "--device")
        refuse_cuda_on_cpu_ranks(cfg.train.device, "train.device")
    if ranks is not None or args.device:
        os.environ["NDP_DEVICE"] = "cpu" if ranks is not None else args.device
    job_device(cfg)
    if not _inside_launcher():  # inside, rank 0 checks the same and takes the folder's lock
        from ndparallel.train.checkpoint_folder import check_before_start

        check_before_start(cfg.checkpoint)
    if ranks is not None and not _inside_launcher():
        # One clear error here, before any rank starts, instead of one per rank after spawning.
        cfg.check_mesh(cfg.parallelism.resolve(ranks))
        return launch(["--cpu-ranks", str(ranks), "--", *without_option(args.argv, "--cpu-ranks")])
    from ndparallel.distributed.process import destroy_distributed
    from ndparallel.train import train

    result = train(cfg)
    destroy_distributed()
    return EXIT_INTERRUPTED if result.interrupted else 0


def _train_config(args: argparse.Namespace):
    """``ndparallel train``'s TrainConfig: the YAML (or defaults), the environment, overrides, --steps, --resume."""
    from ndparallel.distributed.timeouts import TIMEOUT_ENV
    from ndparallel.train.job_config import TrainConfig

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.timeout is not None:
        overrides.append(f"train.timeout_s={args.timeout}")
    elif os.environ.get(TIMEOUT_ENV):  # ndparallel launch --timeout S: over the YAML, under the overrides
        overrides.insert(0, f"train.timeout_s={os.environ[TIMEOUT_ENV]}")
    if args.resume:
        overrides.append("checkpoint.resume=true")
    return TrainConfig.from_sources(args.config, overrides, os.environ)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ndparallel", description="N-dimensional parallel training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("mesh", help="validate a config and print the rank layout of its mesh")
    p.add_argument("config", help="YAML file (a parallelism: section or bare fields)")
    p.add_argument("--world-size", type=int, default=None, help="resolve -1 sizes against this world size")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. tp_size=2")
    p.set_defaults(func=_cmd_mesh)

    p = sub.add_parser("train", help="train the reference transformer (one process, torchrun, or --cpu-ranks N)")
    p.add_argument("--config", help="training YAML (default: tiny model, one rank)")
    p.add_argument("--cpu-ranks", default=None, help="simulate N gloo ranks on this CPU (uses torchrun)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--steps", type=int, default=None, help="shortcut for train.steps=N")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="shortcut for train.timeout_s: a rank waiting this long for its peers ends the job, naming who is behind",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in checkpoint.dir")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.steps=50 tp_size=2")
    p.set_defaults(func=_cmd_train)

    sub.add_parser(
        "launch",
        help="torchrun underneath: ndparallel launch [torchrun options] [--cpu-ranks N] -- SUBCOMMAND|SCRIPT ...",
        add_help=False,
    )
    _add_optional_subcommands(sub)
    return parser


def _add_optional_subcommands(sub: argparse._SubParsersAction) -> None:
    try:
        from ndparallel.estimate.cli import add_plan_parser
    except ImportError:
        pass
    else:
        plan = add_plan_parser(sub)
        try:
            from ndparallel.dryrun.cli import add_plan_dry_run
        except ImportError:
            pass
        else:
            add_plan_dry_run(plan)  # plan --dry-run
    try:
        from ndparallel.bench import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    try:
        from ndparallel.verify.cli import add_verify_parser
    except ImportError:
        pass
    else:
        add_verify_parser(sub)
    try:
        from ndparallel.dryrun.cli import add_dry_run_parser
    except ImportError:
        pass
    else:
        add_dry_run_parser(sub)


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        if len(argv) == 1 or argv[1] in ("-h", "--help"):
            print(__doc__.strip())
            usage = "ndparallel launch [torchrun options] [--cpu-ranks N] [--timeout S] -- SUBCOMMAND|SCRIPT [args]"
            print(f"\nusage: {usage}")
            return 0
        return launch(argv[1:])
    parser = _parser()
    # Overrides (key=value) may follow options, which plain parse_args refuses for a nargs="*" positional.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    args.argv = argv
    return args.func(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; bad input prints one clear line instead of a traceback."""
    from ndparallel.launch.exit_collections import skip_collections_at_exit

    skip_collections_at_exit()  # the launcher, the `train` ranks and every other subcommand
    entry = _main
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun: record a failing rank's traceback so the agent's summary shows it.
        from torch.distributed.elastic.multiprocessing.errors import record

        entry = record(_main)
    try:
        return entry(argv)
    except (ConfigError, CheckpointError) as err:
        _error_line(err)
        return 2
    except (JobError, DivergenceError) as err:  # a lost/hung peer named by the watchdog, or NaN training
        _error_line(err)
        return 1


def _error_line(err: Exception) -> None:
    # One write call: ranks sharing one stderr pipe must not glue their lines together
    # (print() writes the text and the newline separately).
    from ndparallel.distributed.process import exit_without_barrier

    exit_without_barrier()  # peers may never reach an exit barrier: this rank must not wait for them
    sys.stderr.write(f"ndparallel: error: {err}\n")
    sys.stderr.flush()
