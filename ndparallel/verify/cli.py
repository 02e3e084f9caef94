"""The ``ndparallel verify`` subcommand: the table, the JSON, and exit 1 on any failure."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["add_verify_parser"]


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="prove a model trains the same on each mesh layout as in one process (gloo ranks on this CPU)",
    )
    p.add_argument("--model", required=True, help="a preset (tiny), an HF config.json or folder, or module:factory")
    p.add_argument("--tp-plan", default=None, help="module:attr, a {fqn: ParallelStyle} dict or a callable(model)")
    p.add_argument("--layouts", default="auto", help="auto, or e.g. 'dp_shard=2;tp=2;dp_shard=2,tp=2'")
    p.add_argument("--dtype", choices=("float64", "float32", "bf16"), default="float64")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="global batch, sequences")
    p.add_argument("--cpu-ranks", type=int, default=4, help="the most gloo ranks a layout may use")
    p.add_argument("--localize", action="store_true", help="name the first module where a failing layout differs")
    p.add_argument(
        "--shrink",
        action="store_true",
        help="a preset or HF config at its architecture's tiny sizes (2 layers, small width), said in the output",
    )
    p.add_argument(
        "--reshard",
        default=None,
        metavar="A>B[;C>D]",
        help="save a checkpoint on layout A after steps // 2, load it on B, train on: must equal the reference",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write every number to FILE")
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    from ndparallel.config.paths import check_writable_file
    from ndparallel.verify.api import verify

    if args.json:  # before the run: a report that cannot be written must not cost a run, nor turn a PASS into 1
        check_writable_file(args.json, "--json")
    start = time.monotonic()
    table = verify(
        args.model,
        args.layouts,
        dtype=args.dtype,
        tp_plan=args.tp_plan,
        steps=args.steps,
        seq=args.seq,
        batch=args.batch,
        cpu_ranks=args.cpu_ranks,
        localize_failures=args.localize,
        shrink=args.shrink,
        reshard=args.reshard,
        progress=_progress,
    )
    print(table.format())
    print(f"verify: {time.monotonic() - start:.0f}s")
    if args.json:
        try:
            table.write_json(args.json)
        except OSError as err:  # checked before the run: the disk filled, or the path changed meanwhile
            print(f"ndparallel: error: --json={args.json!r}: could not write the report ({err})", file=sys.stderr)
            return 2
    return 0 if table.ok else 1


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
