"""Data parallel through ``ndparallel.Accelerator()`` against 🤗 Accelerate's DDP, on the same CPU ranks:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.bench_accelerate --steps 30

One launch holds both: Accelerate's ``Accelerator(cpu=True)`` starts the process group and ndparallel's reuses
it; each prepares its own copy of one model (same seed), optimizer and loader, and the two training loops run
interleaved, one step each in turn, so load from other processes hits them alike. A step is Accelerate's
loop body: forward, loss, ``accelerator.backward`` (the gradient all-reduce: DDP's buckets, or ndparallel's
bucketed reducer), ``optimizer.step()``, ``zero_grad()``. The step time is the slowest rank's; the table shows
medians after ``--warmup`` steps, and the largest difference between the two models' weights at the end (the
same training: 0 on 2 ranks).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import accelerate

    import ndparallel

    runs = {}
    for name, make in (("accelerate DDP", accelerate.Accelerator), ("ndparallel", ndparallel.Accelerator)):
        acc = make(cpu=True)
        model = _model(args.width, args.depth)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(1)
        samples = args.batch * dist.get_world_size() * (args.steps + args.warmup)
        data = TensorDataset(torch.randn(samples, args.width), torch.randn(samples, 1))
        loader = DataLoader(data, batch_size=args.batch, shuffle=True)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        runs[name] = {"acc": acc, "model": model, "optimizer": optimizer, "batches": iter(loader), "times": []}
    for step in range(args.steps + args.warmup):
        for run in runs.values():
            features, target = next(run["batches"])
            dist.barrier()
            start = time.perf_counter()
            loss = nn.functional.mse_loss(run["model"](features), target)
            run["acc"].backward(loss)
            run["optimizer"].step()
            run["optimizer"].zero_grad()
            elapsed = _slowest(time.perf_counter() - start)
            if step >= args.warmup:
                run["times"].append(elapsed)
    ours = dict(runs["ndparallel"]["model"].named_parameters())
    theirs = {k.removeprefix("module."): v for k, v in runs["accelerate DDP"]["model"].named_parameters()}
    difference = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in ours.values())
        print(f"{dist.get_world_size()} ranks, {params / 1e6:.1f}M parameters, batch {args.batch}, {args.steps} steps")
        base = statistics.median(runs["accelerate DDP"]["times"])
        print(f"{'variant':<16}{'median ms':>10}{'vs DDP':>8}")
        for name, run in runs.items():
            median = statistics.median(run["times"])
            print(f"{name:<16}{median * 1e3:>10.1f}{median / base:>8.2f}")
        print(f"largest weight difference after training: {difference:.2e}")


if __name__ == "__main__":
    main()
