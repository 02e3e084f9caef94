"""Context parallel: activation memory per rank and step time vs cp size, at one long sequence.

    python -m benchmarks.bench_context_parallel --cp 1 2 4 --seq 4096 --steps 3

For each cp size, ``cp`` gloo CPU ranks (one process each) train one sequence of ``--seq`` tokens
through the reference Transformer with ring attention (``apply_context_parallel`` +
``context_parallel``), forward + loss + backward, no optimizer. Per rank it records:

==================  =========================================================================
saved activations   bytes autograd keeps for backward at the end of forward (every tensor saved
                    by any op, parameters excluded, each storage counted once): the activation
                    memory that context parallel divides; exact and load-independent
peak RSS            the process's resident-set high-water mark after the run (parameters,
                    torch, allocator caches and transient buffers included; indicative only)
step time           median over timed steps of the slowest rank's forward + backward
==================  =========================================================================

cp = 1 is the plain model in one process. On a machine with fewer cores than ranks the ranks
share cores, so step time shows overhead, not speed-up: compare it across cp only on dedicated cores.
"""

from __future__ import annotations

import argparse
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


def _rank_main(model_cfg: TransformerConfig, seq: int, steps: int, warmup: int, rotate: str, balance: bool) -> dict:
    import ndparallel as ndp
    from ndparallel.plans.context_parallel import apply_context_parallel, context_parallel, make_positions

    cp = dist.get_world_size()
    cfg = ndp.ParallelismConfig(cp_size=cp, cp_rotate_method=rotate, cp_load_balance=balance)
    mesh = ndp.init_distributed(cfg)
    model = apply_context_parallel(Transformer(model_cfg), mesh, mesh.config)
    data = torch.randint(0, model_cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    times, saved = [], 0
    for step in range(warmup + steps):
        tokens, labels = data[:, :-1].clone(), data[:, 1:].clone()
        positions = make_positions(tokens)
        counter = SavedBytes(model)
        dist.barrier()
        start = time.perf_counter()
        with context_parallel(mesh, [tokens, labels, positions], seq_dims=[1, 1, 0]):
            with counter.hooks():
                loss = F.cross_entropy(model(tokens, positions).flatten(0, 1), labels.flatten())
            loss.backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(elapsed)
        saved = counter.total
    return {"times": times, "saved": saved, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(cp: int, args: argparse.Namespace, model_cfg: TransformerConfig) -> dict:
    """Run one cp size; the slowest rank's median step time and the largest per-rank memory."""
    job = (model_cfg, args.seq, args.steps, args.warmup, args.rotate, not args.no_load_balance)
    results = run_distributed(_rank_main, cp, *job, timeout=1800, threads_per_rank=args.threads)
    step = statistics.median(map(max, zip(*(r["times"] for r in results), strict=True)))
    return {
        "cp": cp,
        "saved_mib": max(r["saved"] for r in results) / 2**20,
        "rss_mib": max(r["max_rss"] for r in results) / 2**20,
        "step_s": step,
    }


def format_table(rows: list[dict]) -> str:
    base = rows[0]
    ratio = f"vs cp={base['cp']}"
    lines = [
        f"{'cp':>3} {'tokens/rank':>12} {'saved act. MiB/rank':>20} {ratio:>8} {'peak RSS MiB/rank':>18} {'step s':>7}",
        "-" * 74,
    ]
    for r in rows:
        lines.append(
            f"{r['cp']:>3} {r['tokens']:>12} {r['saved_mib']:>20.1f} {r['saved_mib'] / base['saved_mib']:>8.3f} "
            f"{r['rss_mib']:>18.0f} {r['step_s']:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rotate", choices=("ring", "allgather"), default="ring")
    parser.add_argument("--no-load-balance", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cpus // cp)")
    args = parser.parse_args(argv)
    model_cfg = TransformerConfig.from_preset(args.preset, max_seq_len=args.seq)
    start = time.time()
    rows = []
    for cp in args.cp:
        row = measure(cp, args, model_cfg)
        rows.append({**row, "tokens": args.seq // cp})
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cpu(s), load average {os.getloadavg()[0]:.1f} at the end, "
        f"threads per rank {args.threads or 'cpus // cp (at least 1)'}; "
        f"preset {args.preset} ({model_cfg.num_params() / 1e6:.1f}M params, dim {model_cfg.dim}, "
        f"{model_cfg.n_layers} layers, {model_cfg.n_heads} heads / {model_cfg.n_kv_heads} kv), "
        f"batch 1 x seq {args.seq}, "
        f"rotate={args.rotate}, load_balance={not args.no_load_balance}, {args.steps} timed steps after "
        f"{args.warmup} warmup, {time.time() - start:.0f} s total"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
