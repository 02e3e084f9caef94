"""The ``ndparallel`` command: ``mesh``, ``train``, ``launch``, ``plan``, ``bench``.

``launch`` is a thin layer over ``torch.distributed.run`` (torchrun): every torchrun option
(``--nnodes``, ``--rdzv-endpoint``, ``--max-restarts``, ...) works unchanged, and ``--cpu-ranks N``
adds the defaults for simulating N gloo ranks on one CPU machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ndparallel.config import ParallelismConfig, load_yaml_mapping
from ndparallel.errors import ConfigError

__all__ = ["main"]

SUBCOMMANDS = ("mesh", "train", "launch", "plan", "bench")


def _cmd_mesh(args: argparse.Namespace) -> int:
    from ndparallel.mesh import format_rank_table

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
    cfg = _train_config(args)
    if args.cpu_ranks and not _inside_launcher():
        # One clear error here, before any rank starts, instead of one per rank after spawning.
        cfg.check_mesh(cfg.parallelism.resolve(args.cpu_ranks))
        return launch(["--cpu-ranks", str(args.cpu_ranks), "--", *_without_option(args.argv, "--cpu-ranks")])
    if args.cpu_ranks or args.device == "cpu":
        os.environ["NDP_DEVICE"] = "cpu"
    from ndparallel.mesh import destroy_distributed
    from ndparallel.train import train

    result = train(cfg)
    destroy_distributed()
    return 130 if result.interrupted else 0


def _train_config(args: argparse.Namespace):
    """``ndparallel train``'s TrainConfig: the YAML (or defaults), the environment, overrides, --steps, --resume."""
    from ndparallel.train.config import TrainConfig

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.resume:
        overrides.append("checkpoint.resume=true")
    return TrainConfig.from_sources(args.config, overrides, os.environ)


def _option_value(argv: Sequence[str], option: str) -> str | None:
    """The value of ``option VALUE`` / ``option=VALUE`` in ``argv`` ("" when the value is missing)."""
    for i, arg in enumerate(argv):
        if arg == option:
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def _without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` minus ``option VALUE`` / ``option=VALUE``."""
    result, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            result.append(arg)
    return result


def _torchrun_argv(argv: Sequence[str]) -> list[str]:
    """Translate ``[torchrun options] [--cpu-ranks N] -- SUBCOMMAND|SCRIPT args`` into torchrun's argv."""
    argv = list(argv)
    if "--" not in argv:
        raise ConfigError(
            "launch needs `--` before the program: ndparallel launch --cpu-ranks 4 -- train --config configs/demo.yaml"
        )
    split = argv.index("--")
    options, program = argv[:split], argv[split + 1 :]
    if not program:
        raise ConfigError("launch: nothing to run after `--` (an ndparallel subcommand or a script)")
    cpu_ranks = _option_value(options, "--cpu-ranks")
    if cpu_ranks is not None:
        try:
            ranks = int(cpu_ranks)
        except ValueError:
            raise ConfigError("--cpu-ranks needs a positive integer, e.g. --cpu-ranks 4") from None
        if ranks < 1:
            raise ConfigError(f"--cpu-ranks={ranks} must be >= 1")
        options = _without_option(options, "--cpu-ranks")
        if not any(o.startswith(("--nproc-per-node", "--nproc_per_node")) for o in options):
            options += ["--nproc-per-node", str(ranks)]
        if not any(o.startswith(("--nnodes", "--rdzv", "--standalone", "--master")) for o in options):
            options.append("--standalone")
        os.environ["NDP_DEVICE"] = "cpu"
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    if program[0] in SUBCOMMANDS:
        return [*options, "-m", "ndparallel", *program]
    return [*options, *program]


def launch(argv: Sequence[str]) -> int:
    """Run ``torch.distributed.run`` (torchrun) with translated arguments; returns its exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    torchrun_args = _torchrun_argv(argv)
    try:
        torchrun_main(torchrun_args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        others = sorted(set(err.failures) - {rank})
        stopped = f"; ranks {others} were stopped" if others else ""
        print(
            f"ndparallel launch: rank {rank} failed first (exit code {failure.exitcode}){stopped}. "
            "Its traceback is above.",
            file=sys.stderr,
        )
        return 1
    return 0


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
    p.add_argument("--cpu-ranks", type=int, default=0, help="simulate N gloo ranks on this CPU (uses torchrun)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--steps", type=int, default=None, help="shortcut for train.steps=N")
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
        from ndparallel.plan_cli import add_plan_parser
    except ImportError:
        pass
    else:
        add_plan_parser(sub)
    try:
        from ndparallel.bench import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        if len(argv) == 1 or argv[1] in ("-h", "--help"):
            print(__doc__.strip())
            print("\nusage: ndparallel launch [torchrun options] [--cpu-ranks N] -- SUBCOMMAND|SCRIPT [args]")
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
    entry = _main
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun: record a failing rank's traceback so the agent's summary shows it.
        from torch.distributed.elastic.multiprocessing.errors import record

        entry = record(_main)
    try:
        return entry(argv)
    except ConfigError as err:
        print(f"ndparallel: error: {err}", file=sys.stderr)
        return 2
