"""Context parallel: activation memory, bytes sent and step time per rank vs cp size and method, at one long sequence.

    python -m benchmarks.bench_context_parallel --cp 1 2 4 --seq 4096 --steps 3
    python -m benchmarks.bench_context_parallel --cp 2 4 --rotate ring allgather alltoall   # side by side

For each cp size, ``cp`` gloo CPU ranks (one process each) train one sequence of ``--seq`` tokens
through the reference Transformer with context-parallel attention (``apply_context_parallel`` +
``context_parallel``), forward + loss + backward, no optimizer. With several ``--rotate`` methods,
one model per method lives in the same ranks and every step runs each method in turn, so a
machine whose load drifts slows them alike. Per rank and method it records:

==================  =========================================================================
saved activations   bytes autograd keeps for backward at the end of forward (every tensor saved
                    by any op, parameters excluded, each storage counted once): the activation
                    memory that context parallel divides; exact and load-independent
sent / payload      bytes of the cp collectives of one step, counted by ``CommCounter`` in the
                    (untimed) warm-up step: payload as the estimator counts it, and sent = what
                    leaves the rank (send: all of it; all-gather, reduce-scatter, all-to-all:
                    (cp-1)/cp of it); exact and load-independent
peak RSS            the process's resident-set high-water mark after the run (parameters,
                    torch, allocator caches and transient buffers included; shared by the
                    methods of one run; indicative only)
step time           median over timed steps of the slowest rank's forward + backward
==================  =========================================================================

cp = 1 is the plain model in one process. On a machine with fewer cores than ranks the ranks
share cores, so step time shows overhead, not speed-up: compare it across cp only on dedicated cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed


class SavedBytes:
    """Counts the bytes autograd saves for backward (each storage once, parameters excluded)."""

    def __init__(self, model: torch.nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _rank_main(model_cfg: TransformerConfig, seq: int, steps: int, warmup: int, rotates, balance: bool) -> dict:
    import ndparallel as ndp
    from ndparallel.distributed.counter import CommCounter
    from ndparallel.estimate.comm import BUS_FACTOR
    from ndparallel.parallel.context_parallel import apply_context_parallel, context_parallel, make_positions

    cp = dist.get_world_size()
    models, meshes = {}, {}
    for rotate in rotates:
        cfg = ndp.ParallelismConfig(cp_size=cp, cp_rotate_method=rotate, cp_load_balance=balance)
        meshes[rotate] = ndp.init_distributed(cfg)
        models[rotate] = apply_context_parallel(Transformer(model_cfg), meshes[rotate], cfg)
    data = torch.randint(0, model_cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    out = {rotate: {"times": [], "saved": 0, "payload": 0, "sent": 0} for rotate in rotates}
    for step in range(warmup + steps):
        for rotate in rotates:
            model, mesh, result = models[rotate], meshes[rotate], out[rotate]
            tokens, labels = data[:, :-1].clone(), data[:, 1:].clone()
            positions = make_positions(tokens)
            saved = SavedBytes(model)
            comm = CommCounter() if step == 0 else None  # counted in the first (untimed) step only
            dist.barrier()
            start = time.perf_counter()
            with comm or contextlib.nullcontext():
                with context_parallel(mesh, [tokens, labels, positions], seq_dims=[1, 1, 0]):
                    with saved.hooks():
                        loss = F.cross_entropy(model(tokens, positions).flatten(0, 1), labels.flatten())
                    loss.backward()
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if step >= warmup:
                result["times"].append(elapsed)
            result["saved"] = saved.total
            if comm is not None:
                result["payload"] = sum(c.payload_bytes for c in comm.calls)
                result["sent"] = sum(c.payload_bytes * BUS_FACTOR[c.kind](c.group_size) for c in comm.calls)
    return {"methods": out, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(cp: int, args: argparse.Namespace, model_cfg: TransformerConfig) -> list[dict]:
    """Run one cp size (every method in the same ranks); per method the slowest rank's median step time and
    the largest per-rank memory and bytes."""
    rotates = args.rotate if cp > 1 else ["ring"]  # cp = 1: the plain model, no cp communication
    job = (model_cfg, args.seq, args.steps, args.warmup, rotates, not args.no_load_balance)
    results = run_distributed(_rank_main, cp, *job, timeout=1800, threads_per_rank=args.threads)
    rows = []
    for rotate in rotates:
        per_rank = [r["methods"][rotate] for r in results]
        rows.append({
            "cp": cp,
            "rotate": rotate if cp > 1 else "-",
            "saved_mib": max(r["saved"] for r in per_rank) / 2**20,
            "sent_mib": max(r["sent"] for r in per_rank) / 2**20,
            "payload_mib": max(r["payload"] for r in per_rank) / 2**20,
            "rss_mib": max(r["max_rss"] for r in results) / 2**20,
            "step_s": statistics.median(map(max, zip(*(r["times"] for r in per_rank), strict=True))),
        })  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    """One line per (cp, method); ratios against cp = 1 (activations) and against ring at the same cp."""
    base = rows[0]
    ring = {r["cp"]: r for r in rows if r["rotate"] == "ring"}
    header = (
        f"{'cp':>3} {'rotate':>9} {'tokens/rank':>12} {'saved act. MiB':>15} {'vs cp=' + str(base['cp']):>8} "
        f"{'sent MiB':>9} {'payload MiB':>12} {'peak RSS MiB':>13} {'step s':>7} {'vs ring':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ref = ring.get(r["cp"])
        versus = f"{r['step_s'] / ref['step_s']:>8.2f}" if ref else f"{'':>8}"
        lines.append(
            f"{r['cp']:>3} {r['rotate']:>9} {r['tokens']:>12} {r['saved_mib']:>15.1f} "
            f"{r['saved_mib'] / base['saved_mib']:>8.3f} {r['sent_mib']:>9.1f} {r['payload_mib']:>12.1f} "
            f"{r['rss_mib']:>13.0f} {r['step_s']:>7.2f} {versus}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--rotate", nargs="+", choices=("ring", "allgather", "alltoall"), default=["ring"],
        help="cp attention method(s); several run side by side in the same ranks",
    )  # fmt: skip
    parser.add_argument("--no-load-balance", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cpus // cp)")
    args = parser.parse_args(argv)
    model_cfg = TransformerConfig.from_preset(args.preset, max_seq_len=args.seq)
    start = time.time()
    rows = []
    for cp in args.cp:
        rows += [{**row, "tokens": args.seq // cp} for row in measure(cp, args, model_cfg)]
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cpu(s), load average {os.getloadavg()[0]:.1f} at the end, "
        f"threads per rank {args.threads or 'cpus // cp (at least 1)'}; "
        f"preset {args.preset} ({model_cfg.num_params() / 1e6:.1f}M params, dim {model_cfg.dim}, "
        f"{model_cfg.n_layers} layers, {model_cfg.n_heads} heads / {model_cfg.n_kv_heads} kv), "
        f"batch 1 x seq {args.seq}, "
        f"rotate={' '.join(args.rotate)}, load_balance={not args.no_load_balance}, {args.steps} timed steps after "
        f"{args.warmup} warmup, {time.time() - start:.0f} s total"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
