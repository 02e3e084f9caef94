"""One-GPU benchmark: ndparallel's path against plain PyTorch, plus a 4-rank correctness check on the GPU.

    python benchmarks/gpu.py                     # H200/H100: 1b preset, seq 4096, bf16, a few minutes
    python benchmarks/gpu.py --micro-batch 8     # the configuration of the 86.1k tok/s baseline
    python benchmarks/gpu.py --dry-run           # tiny shapes on CPU, no compile: checks the script runs

Variants, all timed the same way (``--warmup`` steps, then ``--steps`` synchronised steps; AdamW,
fused on CUDA; loss in fp32):

``torch-eager``      plain model, ``torch.autocast(bf16)``
``torch-compiled``   plain model, each block ``.compile()`` plus a compiled loss head (final norm +
                     output + cross-entropy in one graph): the best plain-PyTorch recipe in DESIGN.md
``ndp-compile``      ``ndparallel.parallelize`` (compile="blocks": each block and the loss head, output
                     projection + cross-entropy in one graph) on a 1-rank mesh, autocast bf16 (at dp_shard 1
                     parallelize applies no FSDP)
``ndp-fsdp1``        the same plus FSDP2 on the 1-rank ``dp_shard_cp`` mesh with bf16 parameters
                     (``MixedPrecisionPolicy(bf16, fp32)``): the path a multi-GPU job takes

Then ``correctness``: FSDP (dp_shard 4) and FSDP x TP (2 x 2) on 4 gloo ranks holding CUDA tensors
on the one GPU (NCCL refuses two ranks per GPU), fp32, against one process: losses must agree to 1e-5.

MFU uses the data-sheet dense bf16 peak (H100/H200: 989 TFLOP/s). Results: a table and ``--out`` JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ndparallel.distributed.peak import device_peak
from ndparallel.models import Transformer, TransformerConfig

BASELINE_TOKENS_PER_S = 86.1e3  # best plain PyTorch on one H200, DESIGN.md


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_loss_fn(model: Transformer, compiled: bool, compile_kwargs: dict):
    """Loss of the plain model; the head (norm + output + fp32 cross-entropy) compiled when ``compiled``."""

    def head(h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = model.output(model.norm(h)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))

    head_fn = torch.compile(head, **compile_kwargs) if compiled else head

    def loss_fn(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
        h = model.tok_embeddings(tokens)
        for layer in model.layers:
            h = layer(h, cos, sin)
        return head_fn(h, labels)

    return loss_fn


def _build(variant: str, mcfg: TransformerConfig, device: torch.device, use_compile: bool):
    """(model, loss_fn, autocast?) for one variant."""
    with device:
        model = Transformer(mcfg)
    if variant.startswith("torch"):
        compiled = variant == "torch-compiled" and use_compile
        if compiled:
            for block in model.layers:
                block.compile()
        return model, _plain_loss_fn(model, compiled, {}), True
    from ndparallel import ParallelismConfig, init_distributed
    from ndparallel.parallel.fully_shard import apply_fully_shard
    from ndparallel.parallel.loss import cross_entropy_loss
    from ndparallel.parallel.parallelize import find_blocks, parallelize

    cfg = ParallelismConfig(compile="blocks" if use_compile else "none", mixed_precision="bf16")
    mesh = init_distributed(cfg, device_type=device.type)
    fsdp = variant == "ndp-fsdp1"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "mixed_precision is applied by FSDP": we add FSDP (or autocast) below
        model = parallelize(model, cfg, mesh=mesh)
    if fsdp:
        apply_fully_shard(model, mesh["dp_shard_cp"], cfg, find_blocks(model))

    def loss_fn(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if model.loss_in_forward:  # compile="blocks" compiled the projection + cross entropy as one graph
            return model(tokens, labels=labels)
        return cross_entropy_loss(model(tokens).float(), labels)

    return model, loss_fn, not fsdp


def time_variant(variant: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Build, warm up and time one variant; returns its numbers."""
    mcfg = TransformerConfig.from_preset(args.preset, max_seq_len=max(args.seq_len, 16))
    use_compile = not args.dry_run
    model, loss_fn, autocast = _build(variant, mcfg, device, use_compile)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(mcfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator).to(device)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    dtype = torch.bfloat16

    def step() -> torch.Tensor:
        ctx = torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    tokens_per_s = args.micro_batch * args.seq_len / median
    flops = tokens_per_s * mcfg.flops_per_token(args.seq_len)
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    result = dict(
        variant=variant,
        step_median_s=median,
        step_min_s=min(times),
        step_max_s=max(times),
        tokens_per_s=tokens_per_s,
        mfu=flops / args.peak_flops,
        peak_memory_gib=peak_mem / 2**30,
        warmup_s=warmup_s,
        final_loss=float(loss),
    )
    return result


# ------------------------------------------------------------------------------------ correctness


def _losses_on_rank(parallelism: dict, preset: str, seq_len: int, batch: int, steps: int, device_type: str) -> list:
    """fp32 training losses of one mesh shape (every rank returns its view of the global loss)."""
    from ndparallel import ParallelismConfig, init_distributed
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.loss import cross_entropy_loss
    from ndparallel.parallel.parallelize import parallelize

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = ParallelismConfig(**parallelism)
    mesh = init_distributed(cfg, device_type=device_type)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    with device:
        model = Transformer(TransformerConfig.from_preset(preset, max_seq_len=seq_len))
    model = parallelize(model, mesh.config, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = torch.randint(256, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    local = data[dp_rank * batch // dp : (dp_rank + 1) * batch // dp].to(device)
    losses = []
    for _ in range(steps):
        loss = cross_entropy_loss(model(local[:, :-1]), local[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(average_over(mesh["dp_cp"], loss))
    return losses


def correctness(args: argparse.Namespace, device_type: str) -> dict:
    """Multi-rank losses (gloo, tensors on ``device_type``) against one process; max |difference|."""
    import torch.distributed as dist

    from ndparallel.testing import run_distributed

    ranks = 2 if args.dry_run else 4
    shapes = {"fsdp": {"dp_shard_size": ranks}, "fsdp_tp": {"dp_shard_size": ranks // 2, "tp_size": 2}}
    common = ("tiny", 64, 4, 3, device_type)
    reference = _losses_on_rank({}, *common)  # in this process, on a 1-rank group
    dist.destroy_process_group()
    out = {"reference": reference, "ranks": ranks, "device": device_type}
    for name, shape in shapes.items():
        losses = run_distributed(_losses_on_rank, ranks, shape, *common)
        diff = max(abs(a - b) for rank_losses in losses for a, b in zip(rank_losses, reference, strict=True))
        out[name] = {"losses": losses[0], "max_abs_diff": diff, "ok": diff <= 1e-5}
    return out


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU without compile (a smoke test)")
    parser.add_argument("--preset", default=None, help="model preset (default 1b; tiny with --dry-run)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 4096 (64 with --dry-run)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 4 (2 with --dry-run)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps, default 3 (1 with --dry-run)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps, default 8 (2 with --dry-run)")
    parser.add_argument("--variants", default="torch-eager,torch-compiled,ndp-compile,ndp-fsdp1")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--out", default="bench-results/gpu.json")
    args = parser.parse_args(argv)
    dry = args.dry_run
    for name, full, small in (("preset", "1b", "tiny"), ("seq_len", 4096, 64), ("micro_batch", 4, 2),
                              ("warmup", 3, 1), ("steps", 8, 2)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, small if dry else full)
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU smoke test", file=sys.stderr)
        return 2
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = device_peak(device.type, "bf16")
    args.peak_flops = peak.flops
    print(f"torch {torch.__version__} | {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (dry run)'}"
          f" | peak {peak.flops / 1e12:.0f} TFLOP/s ({peak.source}) | {args.preset}, seq {args.seq_len}, "
          f"micro-batch {args.micro_batch}, {args.steps} timed steps", flush=True)  # fmt: skip
    results = []
    for variant in args.variants.split(","):
        r = time_variant(variant.strip(), args, device)
        gc.collect()  # the variant's model and optimizer are unreachable now: free them before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(r)
        print(f"{r['variant']:>15}: {r['tokens_per_s'] / 1e3:7.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  "
              f"step {r['step_median_s'] * 1e3:6.1f} ms ({r['step_min_s'] * 1e3:.1f}-{r['step_max_s'] * 1e3:.1f})  "
              f"peak {r['peak_memory_gib']:.1f} GiB  warm-up {r['warmup_s']:.0f}s  loss {r['final_loss']:.3f}",
              flush=True)  # fmt: skip
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    best_torch = max((r["tokens_per_s"] for r in results if r["variant"].startswith("torch")), default=0.0)
    best_ndp = max((r["tokens_per_s"] for r in results if r["variant"].startswith("ndp")), default=0.0)
    if not dry:
        print(f"best ndparallel {best_ndp / 1e3:.1f}k vs best plain PyTorch here {best_torch / 1e3:.1f}k "
              f"(DESIGN.md bar: {BASELINE_TOKENS_PER_S / 1e3:.1f}k)")  # fmt: skip
    check = None
    if not args.skip_correctness:
        check = correctness(args, device.type)
        for name in ("fsdp", "fsdp_tp"):
            verdict = "OK" if check[name]["ok"] else "FAIL"
            print(f"correctness {name} on {check['ranks']} gloo ranks ({check['device']} tensors): "
                  f"max |dloss| {check[name]['max_abs_diff']:.2e} -> {verdict}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(torch=torch.__version__, device=str(device), args={k: v for k, v in vars(args).items()},
               results=results, correctness=check, baseline_tokens_per_s=BASELINE_TOKENS_PER_S)  # fmt: skip
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    failed = check is not None and not (check["fsdp"]["ok"] and check["fsdp_tp"]["ok"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
