"""Pure data parallel: how much gradient communication does backward hide? ndparallel vs torch DDP.

    python -m benchmarks.bench_replicate --ranks 2 --steps 10

On ``--ranks`` gloo CPU ranks, one process each, times a training step (forward + loss +
backward, including waiting for the gradient average; no optimizer step, which is the same
for every variant) of a ~19M-parameter Transformer for:

=================  ==========================================================================
compute only       no communication at all: the floor
ndparallel         ``apply_replicate``: bucketed all-reduce launched from gradient hooks
ndparallel small   the same with ``--small-bucket-mb`` buckets (more, earlier all-reduces)
torch DDP          ``DistributedDataParallel`` with the same bucket cap
no overlap         same buckets, all-reduced only after backward has finished
=================  ==========================================================================

and the time of all-reducing the gradients alone (``comm only``). Variants run interleaved,
one step each in turn, so load from other processes hits them alike. Step time is the slowest
rank's; the table shows medians. ``exposed comm = step - compute only``; ``overlap = 1 -
exposed / comm only`` (the share of the all-reduce time hidden behind backward).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndparallel.distributed.buckets import GradBucket, all_reduce_buckets, assign_buckets
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed

VARIANTS = ("compute only", "ndparallel", "ndparallel small", "torch DDP", "no overlap")


def model_config(dim: int, layers: int, ffn_dim: int) -> TransformerConfig:
    return TransformerConfig.from_preset("small", dim=dim, n_layers=layers, ffn_dim=ffn_dim)


def _step(model: nn.Module, tokens: torch.Tensor, after_backward=None) -> float:
    dist.barrier()
    start = time.perf_counter()
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    if after_backward is not None:
        after_backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def _rank_main(
    cfg: TransformerConfig, steps: int, warmup: int, batch: int, seq: int, bucket_mb: float, small_bucket_mb: float
) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import ndparallel as ndp
    from ndparallel.parallel.replicate import apply_replicate, replicate_state

    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_replicate_size=dist.get_world_size()))
    dp = mesh["dp_replicate"]
    group, world = dp.get_group(), dp.size()
    cap = int(bucket_mb * 2**20)

    def no_overlap_model() -> tuple[nn.Module, list[GradBucket]]:
        model = Transformer(cfg)
        order = [p for p in model.parameters()][::-1]
        return model, [GradBucket([order[i] for i in idx]) for idx in assign_buckets(order, cap)]

    compute = Transformer(cfg)
    ours = apply_replicate(Transformer(cfg), dp, bucket_mb=bucket_mb)
    ours_small = apply_replicate(Transformer(cfg), dp, bucket_mb=small_bucket_mb)
    ddp = DistributedDataParallel(Transformer(cfg), process_group=group, bucket_cap_mb=bucket_mb)
    plain, buckets = no_overlap_model()
    runs = {
        "compute only": (compute, None),
        "ndparallel": (ours, None),
        "ndparallel small": (ours_small, None),
        "torch DDP": (ddp, None),
        "no overlap": (plain, lambda: all_reduce_buckets(buckets, group, world)),
    }
    generator = torch.Generator().manual_seed(dist.get_rank())
    times: dict[str, list[float]] = {name: [] for name in (*VARIANTS, "comm only")}
    for step in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator)
        for name, (model, after) in runs.items():
            elapsed = _step(model, tokens, after)
            if step >= warmup:
                times[name].append(elapsed)
        # Communication alone: the same buckets, gradients already in place, no compute to hide behind.
        for bucket in buckets:
            for param in bucket.params:
                param.grad = torch.ones_like(param)
        dist.barrier()
        start = time.perf_counter()
        all_reduce_buckets(buckets, group, world)
        if step >= warmup:
            times["comm only"].append(time.perf_counter() - start)
        plain.zero_grad(set_to_none=True)
    return {
        "times": times,
        "n_buckets": len(replicate_state(ours).buckets),
        "n_small_buckets": len(replicate_state(ours_small).buckets),
        "n_params": sum(p.numel() for p in compute.parameters()),
    }


def summarize(results: list[dict], stat=statistics.median) -> dict[str, float]:
    """``stat`` (median by default) over steps of the slowest rank's time, seconds."""
    names = results[0]["times"].keys()
    return {name: stat(map(max, zip(*(r["times"][name] for r in results), strict=True))) for name in names}


def format_table(medians: dict[str, float], minima: dict[str, float]) -> str:
    compute, comm, ddp = medians["compute only"], medians["comm only"], medians["torch DDP"]
    lines = [
        f"{'variant':<17} {'median ms':>10} {'min ms':>8} {'vs DDP':>7} {'exposed comm ms':>16} {'overlap':>8}",
        "-" * 71,
    ]
    for name in VARIANTS:
        step = medians[name]
        if name == "compute only":
            exposed, overlap = "-", "-"
        else:
            exposed_s = step - compute
            exposed, overlap = f"{exposed_s * 1e3:.1f}", f"{1 - exposed_s / comm:.0%}"
        row = f"{name:<17} {step * 1e3:>10.1f} {minima[name] * 1e3:>8.1f} {step / ddp:>7.2f} {exposed:>16} {overlap:>8}"
        lines.append(row)
    lines.append(
        f"{'comm only':<17} {comm * 1e3:>10.1f} {minima['comm only'] * 1e3:>8.1f}   (all-reduce of all gradients alone)"
    )
    lines.append(
        "vs DDP, exposed comm and overlap use medians; exposed = step - compute only, overlap = 1 - exposed / comm only"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ffn-dim", type=int, default=1536)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="ndparallel and DDP bucket cap")
    parser.add_argument("--small-bucket-mb", type=float, default=4.0, help="bucket cap of 'ndparallel small'")
    args = parser.parse_args(argv)
    cfg = model_config(args.dim, args.layers, args.ffn_dim)
    start = time.time()
    results = run_distributed(
        _rank_main,
        args.ranks,
        cfg,
        args.steps,
        args.warmup,
        args.batch,
        args.seq,
        args.bucket_mb,
        args.small_bucket_mb,
        timeout=900,
    )
    medians, minima = summarize(results), summarize(results, min)
    first = results[0]
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    print(f"torch {torch.__version__}, {args.ranks} gloo ranks x {threads} thread(s) on {os.cpu_count()} cpu(s)")
    print(
        f"model {first['n_params'] / 1e6:.1f}M params (dim {args.dim}, {args.layers} layers, ffn {args.ffn_dim}), "
        f"batch {args.batch} x seq {args.seq} per rank"
    )
    print(
        f"buckets: {args.bucket_mb} MB -> {first['n_buckets']}, small {args.small_bucket_mb} MB -> "
        f"{first['n_small_buckets']}; {args.steps} timed steps after {args.warmup} warmup; "
        f"{time.time() - start:.0f} s total"
    )
    print(format_table(medians, minima))


if __name__ == "__main__":
    main()
