"""``ndparallel plan``: estimate memory / communication / step time and rank mesh shapes.

    ndparallel plan --model 8b --gpus 64 --gpu-mem 80GiB --seq 8192 --global-batch 512 --ac full
    ndparallel plan --model path/to/config.json --gpus 16 --gpu h200 --json
    ndparallel plan --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ffn-dim 14336 --vocab 128256 --gpus 8
    ndparallel plan --model 70b --gpus 64 --pp-schedule gpipe,1f1b,interleaved_1f1b --pp-microbatches 16
    ndparallel plan --model path/to/mixtral/config.json --gpus 64 --ep 8   # a mixture of experts: ep searched
    ndparallel plan --model 8b --gpus 8 --gpu h100-hbm2e --seq 8192 --global-batch 16 --micro-batch 2 \
        --ac selective --selective-ac-option op --compile blocks --dp-shard 8 --explain

``ndparallel.launch.cli`` registers it (``add_plan_parser(subparsers)``, then ``args.func(args)`` = ``run_plan``),
as it registers ``ndparallel.bench.cli``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

from ndparallel.config.parallelism import CHOICES
from ndparallel.config.pipeline import PP_SCHEDULES
from ndparallel.errors import ConfigError
from ndparallel.estimate import (
    GPU_PRESETS,
    PRECISIONS,
    ClusterSpec,
    Estimate,
    ModelSpec,
    Plan,
    TrainingSpec,
    model_spec,
    parse_bandwidth,
    parse_bytes,
    parse_count,
    plan,
)
from ndparallel.estimate.explain import breakdown, format_explain
from ndparallel.estimate.training import ACTIVATION_CHECKPOINTING, COMPILE_MODES
from ndparallel.estimate.units import GiB

PP_COMPARED = ("gpipe", "1f1b", "interleaved_1f1b")
PINNED = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
"""The sizes ``--pp`` ... ``--ep`` pin (ep: a mixture of experts' expert parallelism, inside dp_shard x cp)."""
"""``--pp-schedule all``: the schedules whose memory rule is measured (docs/planning.md)."""

__all__ = ["add_plan_parser", "format_explain", "format_plan", "main", "plan_from_args", "plan_to_json", "run_plan"]

_RAW_COUNTS = {"dim": "dim", "layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads",
               "ffn_dim": "ffn_dim", "vocab": "vocab_size"}  # fmt: skip
_RAW_MOE = {"experts": "n_experts", "top_k": "top_k", "expert_ffn_dim": "expert_ffn_dim",
            "shared_ffn_dim": "shared_ffn_dim"}  # fmt: skip
"""Optional raw counts of a mixture of experts (every block an MoE block)."""


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object; the handler is in ``args.func``."""
    p = subparsers.add_parser(
        "plan",
        help="estimate memory, communication and step time; rank mesh shapes for a cluster",
        description="Predict per-GPU memory and step time of every (pp, dp_replicate, dp_shard, cp, tp) mesh "
        "shape (pp shapes once per --pp-schedule; a mixture of experts also every ep) and rank them. Model: "
        "docs/planning.md.",
    )
    model = p.add_argument_group("model (a preset / config.json, or raw counts)")
    model.add_argument(
        "--model", help="preset name (tiny, tiny-moe, small, 125m, 1b, 8b, 70b) or path to an HF config.json"
    )
    for flag in (*_RAW_COUNTS, *_RAW_MOE):
        model.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, help=argparse.SUPPRESS)
    model.description = (
        "raw counts: --dim --layers --heads [--kv-heads] --ffn-dim --vocab; a mixture of experts adds --experts "
        "[--top-k] [--expert-ffn-dim] [--shared-ffn-dim]"
    )

    cluster = p.add_argument_group("cluster (defaults: --gpu preset)")
    cluster.add_argument("--gpus", type=int, required=True, help="total number of GPUs (world size)")
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument(
        "--gpu", default="h100", help=f"GPU kind (estimate/hardware.py): {', '.join(GPU_PRESETS)} (default h100)"
    )
    cluster.add_argument("--gpu-mem", help="memory per GPU, e.g. 80GiB, 80GB, 141G")
    cluster.add_argument("--intra-bw", help="NVLink bandwidth per GPU and direction, e.g. 450GB/s")
    cluster.add_argument("--inter-bw", help="network bandwidth per GPU, e.g. 50GB/s or 400Gbit/s")
    cluster.add_argument("--peak-flops", help="dense peak FLOP/s per GPU in the compute dtype, e.g. 989T")
    cluster.add_argument("--hbm-bw", help="HBM bandwidth per GPU, e.g. 3.35TB/s (memory-bound kernels)")
    cluster.add_argument(
        "--mfu", type=float, default=None,
        help="override the kernel model: every FLOP at peak x MFU, no memory-bound time (e.g. 0.5)",
    )  # fmt: skip
    cluster.add_argument("--memory-margin", type=float, default=0.1, help="fraction of memory kept free (0.1)")

    train = p.add_argument_group("training")
    train.add_argument("--seq", type=int, default=None, help="sequence length (default: 4096)")
    train.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step (256)")
    train.add_argument("--micro-batch", type=int, default=1, help="sequences per forward on one dp rank (1)")
    train.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    train.add_argument(
        "--ac", default="none", choices=list(ACTIVATION_CHECKPOINTING),
        help="activation checkpointing, torchtitan's modes: none, full, selective (see --selective-ac-option)",
    )  # fmt: skip
    train.add_argument(
        "--selective-ac-option", default="2",
        help="--ac selective: 'op' (per-op: save matmul / attention / reduce-scatter outputs, every second matmul "
        "recomputed; planner only, ndparallel train runs per-layer) or N (every N-th block; default 2, ndparallel's)",
    )  # fmt: skip
    train.add_argument(
        "--compile", default="none", choices=list(COMPILE_MODES),
        help="torch.compile: none, blocks (each block), model (whole model), torchtitan's meaning: the loss stays "
        "eager (ndparallel's own compile: blocks also compiles its loss head: add --compiled-loss)",
    )  # fmt: skip
    train.add_argument(
        "--compiled-loss", action="store_true",
        help="the loss head (final norm + output + fp32 cross-entropy) compiled in one graph",
    )  # fmt: skip
    train.add_argument(
        "--composite-norm", action="store_true",
        help="RMSNorm as eager composite ops (e.g. torchtitan's norm_type=rmsnorm), not the fused CUDA kernel",
    )  # fmt: skip
    train.add_argument("--no-reshard-after-forward", action="store_true", help="FSDP keeps units gathered")
    train.add_argument(
        "--cp-rotate-method", default="ring", choices=list(CHOICES["cp_rotate_method"]),
        help="context-parallel attention: ring (default), allgather, alltoall (Ulysses; heads / tp must divide by cp)",
    )  # fmt: skip
    train.add_argument(
        "--no-cp-load-balance", action="store_true",
        help="context parallel cuts the sequence into cp pieces, not 2 x cp (cp_load_balance=false)",
    )  # fmt: skip
    train.add_argument(
        "--defer-grad-sync", action="store_true",
        help="FSDP: reduce-scatter gradients once per step, keeping them unsharded between micro-batches "
        "(train.defer_grad_sync); default: every micro-batch, as ndparallel train does",
    )  # fmt: skip
    # The default since train.defer_grad_sync; still accepted so scripts that pass it keep working.
    train.add_argument("--grad-sync-every-microbatch", action="store_true", help=argparse.SUPPRESS)

    pipe = p.add_argument_group("pipeline parallel (pp shapes are searched unless --no-pp)")
    pipe.add_argument(
        "--pp-schedule", default="1f1b",
        help=f"schedule(s) to compare, comma-separated, or 'all' ({', '.join(PP_COMPARED)}); "
        f"choices {', '.join(PP_SCHEDULES)} (default 1f1b)",
    )  # fmt: skip
    pipe.add_argument("--pp-microbatches", type=int, default=0, help="pipeline micro-batches m (default: accumulation)")
    pipe.add_argument("--pp-stages-per-rank", type=int, default=0, help="stages per pp rank (default 1, interleaved 2)")
    pipe.add_argument("--no-pp", action="store_true", help="search shapes without pipeline parallelism only")

    out = p.add_argument_group("search and output")
    for dim in PINNED:
        out.add_argument(f"--{dim.replace('_', '-')}", type=int, dest=f"pin_{dim}", help=f"pin {dim} size")
    out.add_argument("--top", type=int, default=10, help="how many ranked shapes to print (10)")
    out.add_argument("--rejected", type=int, default=8, help="how many rejected shapes to print (8)")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument(
        "--explain", action="store_true",
        help="the best shape's step-time breakdown: compute by kind, exposed communication by dim, bubble",
    )  # fmt: skip
    p.set_defaults(func=run_plan)
    return p


def _model_from_args(args: argparse.Namespace) -> ModelSpec:
    raw = {field: getattr(args, flag) for flag, field in _RAW_COUNTS.items() if getattr(args, flag, None)}
    moe = {field: getattr(args, flag) for flag, field in _RAW_MOE.items() if getattr(args, flag, None) is not None}
    if args.model and (raw or moe):
        raise ConfigError("give either --model or raw counts (--dim --layers ...), not both")
    if moe and not raw:
        raise ConfigError(f"{', '.join('--' + f.replace('_', '-') for f in moe)} need the raw counts (--dim ...)")
    raw.update(moe)
    if args.model:
        return model_spec(args.model)
    if not raw:
        raise ConfigError("no model: pass --model PRESET|config.json or --dim --layers --heads --ffn-dim --vocab")
    missing = [f"--{f.replace('_', '-')}" for f in _RAW_COUNTS if f != "kv_heads" and getattr(args, f) is None]
    if missing:
        raise ConfigError(f"raw model counts need {', '.join(missing)} as well")
    return model_spec(raw)


def _cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    overrides: dict[str, Any] = {
        "num_gpus": args.gpus, "gpus_per_node": min(args.gpus_per_node, args.gpus) if args.gpus > 0 else 1,
        "mfu": args.mfu, "memory_margin": args.memory_margin,
    }  # fmt: skip
    if args.mfu is None:
        del overrides["mfu"]
    if args.gpus is None or args.gpus < 1:
        raise ConfigError(f"--gpus={args.gpus} must be a positive integer")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={args.gpus_per_node} must be a positive integer")
    if args.gpu_mem:
        overrides["gpu_memory"] = parse_bytes(args.gpu_mem, "--gpu-mem")
    if args.intra_bw:
        overrides["intra_node_bw"] = parse_bandwidth(args.intra_bw, "--intra-bw")
    if args.inter_bw:
        overrides["inter_node_bw"] = parse_bandwidth(args.inter_bw, "--inter-bw")
    if args.peak_flops:
        overrides["peak_flops"] = parse_count(args.peak_flops, "--peak-flops")
    if args.hbm_bw:
        overrides["hbm_bw"] = parse_bandwidth(args.hbm_bw, "--hbm-bw")
    return ClusterSpec.from_gpu(args.gpu, **overrides)


def _training_from_args(args: argparse.Namespace) -> TrainingSpec:
    return TrainingSpec(
        global_batch=args.global_batch,
        seq_len=4096 if args.seq is None else args.seq,  # an explicit 0 is refused, not replaced
        micro_batch=args.micro_batch,
        precision=args.precision,
        activation_checkpointing=args.ac,
        selective_ac_option=str(args.selective_ac_option),
        compile=args.compile,
        compiled_loss=args.compiled_loss,
        fused_norm=not args.composite_norm,
        reshard_after_forward=not args.no_reshard_after_forward,
        cp_rotate_method=args.cp_rotate_method,
        cp_load_balance=not args.no_cp_load_balance,
        defer_grad_sync=args.defer_grad_sync,
    )


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan the ``plan`` arguments ask for (``ndparallel plan --dry-run`` starts from it too); ConfigError on
    bad input."""
    model = _model_from_args(args)
    cluster = _cluster_from_args(args)
    train = _training_from_args(args)
    fixed = {dim: getattr(args, f"pin_{dim}") for dim in PINNED}
    fixed = {k: v for k, v in fixed.items() if v is not None}
    for flag in ("top", "rejected"):
        _non_negative(getattr(args, flag), f"--{flag}")
    if args.top == 0:  # printed an empty table, exit 0
        raise ConfigError("--top=0 would print no shape: give --top 1 or more (10 by default)")
    _check_pinned_ep(model, fixed.get("ep", 1))
    if args.no_pp and fixed.get("pp", 1) > 1:
        raise ConfigError(f"--no-pp contradicts --pp {fixed['pp']}")
    return plan(
        model, train, cluster, fixed, search_pp=not args.no_pp, pp_schedules=_pp_schedules(args.pp_schedule),
        pp_microbatches=_non_negative(args.pp_microbatches, "--pp-microbatches"),
        pp_stages_per_rank=_non_negative(args.pp_stages_per_rank, "--pp-stages-per-rank"),
    )  # fmt: skip


def run_plan(args: argparse.Namespace) -> int:
    """Handler of ``ndparallel plan``: 0 when some shape fits, 1 when none does, 2 on bad input."""
    try:
        result = plan_from_args(args)
    except ConfigError as err:
        print(f"ndparallel plan: error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(plan_to_json(result, args.top, args.rejected), indent=2) if args.json else None
    if text is None and args.explain and result.best is not None:
        text = format_plan(result, args.top, args.rejected) + "\n\n" + format_explain(result.best)
    try:
        print(text or format_plan(result, args.top, args.rejected))
        sys.stdout.flush()
    except BrokenPipeError:  # `ndparallel plan ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if result.ranked else 1


def _check_pinned_ep(model: ModelSpec, ep: int) -> None:
    """A pinned ``--ep`` that no shape can take, refused first (it used to headline "no mesh shape fits: try
    --ac full", with the cause only in the rejected rows)."""
    if ep > 1 and model.is_moe and model.n_experts % ep:
        raise ConfigError(
            f"--ep {ep} does not divide the model's {model.n_experts} experts (each ep rank owns experts / ep of "
            f"them): choose an --ep that divides {model.n_experts}"
        )


def _pp_schedules(text: str) -> tuple[str, ...]:
    names = PP_COMPARED if text == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PP_SCHEDULES]
    if unknown or not names:
        raise ConfigError(f"--pp-schedule={text!r}: unknown {unknown}; choose from {list(PP_SCHEDULES)} or 'all'")
    return names


def _non_negative(value: int, flag: str) -> int:
    if value < 0:
        raise ConfigError(f"{flag}={value} must be a positive integer (or omitted)")
    return value


def plan_to_json(result: Plan, top: int | None = None, rejected: int | None = None) -> dict[str, Any]:
    """The plan as JSON-ready data (all ranked and rejected shapes unless limited)."""
    return {
        "model": {**result.model.as_dict(), "num_params": result.model.num_params()},
        "cluster": vars(result.cluster),
        "training": vars(result.train),
        "ranked": [e.as_dict() for e in result.ranked[:top]],
        "explain": [list(row) for row in breakdown(result.best)] if result.best else [],
        "rejected": [e.as_dict() for e in result.rejected[:rejected]],
        "num_ranked": len(result.ranked),
        "num_rejected": len(result.rejected),
    }


def _ac_text(t: TrainingSpec) -> str:
    if t.activation_checkpointing != "selective":
        return t.activation_checkpointing
    if t.selective_ac_option == "op":
        return "selective per-op (modelled; ndparallel train runs none / full / selective per-layer 2)"
    return f"selective every {t.selective_ac_option} blocks"


def _experts_text(m: ModelSpec) -> str:
    """The model line's mixture-of-experts part ("" for a dense model)."""
    if not m.is_moe:
        return ""
    shared = f", shared ffn {m.shared_ffn_dim}" if m.shared_ffn_dim else ""
    return (
        f"; {m.n_experts} experts, top-{m.top_k}, expert ffn {m.expert_ffn_dim}{shared}, "
        f"{m.n_moe_layers} of {m.n_layers} blocks MoE, {m.num_active_params() / 1e9:.2f}B active"
    )


def _gib(value: float) -> str:
    return f"{value / GiB:.1f}"


def format_plan(result: Plan, top: int = 10, rejected: int = 8) -> str:
    """Readable tables: header, ranked shapes, the best shape's breakdown, rejected shapes."""
    m, c, t = result.model, result.cluster, result.train
    lines = [
        f"model {m.name}: {m.num_params() / 1e9:.2f}B params (dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads, "
        f"{m.n_kv_heads} kv heads, ffn {m.ffn_dim}, vocab {m.vocab_size}{_experts_text(m)})",
        f"cluster: {c.num_gpus} GPUs, {c.gpus_per_node}/node, {_gib(c.gpu_memory)} GiB each "
        f"({_gib(c.usable_memory)} usable), NVLink {c.intra_node_bw / 1e9:.0f} GB/s, network "
        f"{c.inter_node_bw / 1e9:.0f} GB/s per GPU, {c.peak_flops / 1e12:.0f} TFLOP/s, HBM {c.hbm_bw / 1e12:.2f} TB/s"
        + (f" x flat MFU {c.mfu:.2f} (--mfu override)" if c.mfu is not None else f" ({c.gpu} kernel model)"),
        f"training: global batch {t.global_batch} x seq {t.seq_len}, micro-batch {t.micro_batch}, {t.precision}, "
        f"AdamW, activation checkpointing {_ac_text(t)}, compile {t.compile}"
        + (" + compiled loss head" if t.compiled_loss else "")
        + ("" if t.fused_norm else ", composite RMSNorm"),
        "",
    ]
    mesh = "mesh ([pp sched x] rep x shard x cp x tp" + (" [epN])" if m.is_moe else ")")
    columns = ("#", mesh, "mem/GPU GiB", "step s", "tok/s", "MFU")
    header = "{:>3}  {:<42} {:>11} {:>8} {:>10} {:>6}  why".format(*columns)
    if result.ranked:
        lines += [f"{len(result.ranked)} shapes fit; fastest first:", header]
        for i, e in enumerate(result.ranked[:top], 1):
            lines.append(
                f"{i:>3}  {e.mesh.describe():<42} {_gib(e.memory.peak):>11} {e.time.step_s:>8.2f} "
                f"{e.time.tokens_per_s:>10,.0f} {e.time.mfu:>6.1%}  {e.reason()}"
            )
        lines += ["", *_breakdown(result.ranked[0], m)]
    elif result.rejected and all(e.problems for e in result.rejected):  # refused by rules, none for memory
        reasons = Counter(e.problems[0] for e in result.rejected)
        lines.append(
            f"no mesh shape fits: each is refused, none for memory; most often: {reasons.most_common(1)[0][0]}"
        )
    else:
        lines.append(
            "no mesh shape fits: try activation checkpointing (--ac full), a smaller --micro-batch, or more GPUs"
        )
    if result.rejected and rejected:
        lines += ["", f"{len(result.rejected)} shapes rejected (first {min(rejected, len(result.rejected))}):"]
        for e in result.rejected[:rejected]:
            lines.append(f"     {e.mesh.describe():<42} {_gib(e.memory.peak):>11}  {e.reason()}")
    return "\n".join(lines)


def _breakdown(e: Estimate, model: ModelSpec) -> list[str]:
    mem = e.memory
    acts = ", ".join(f"{k} {_gib(v)}" for k, v in mem.activations_by_mode.items())
    lines = [
        f"best: {e.mesh.describe()}  per-GPU memory GiB: params {_gib(mem.params)}, grads {_gib(mem.grads)}, "
        f"AdamW {_gib(mem.optimizer)}, activations {_gib(mem.activations)} (by checkpointing: {acts}), "
        f"transient {_gib(mem.transient)}"
        + (f", unsharded grads (accumulation) {_gib(mem.accumulated_grads)}" if mem.accumulated_grads else "")
        + f" -> peak {_gib(mem.peak)}",
        *([_pipeline_line(e, model)] if e.mesh.pp > 1 else []),
        f"      compute {e.time.compute_s:.2f} s + exposed comm {e.time.exposed_comm_s:.2f} s "
        f"(of {e.time.comm_s:.2f} s total) per step",
    ]
    for row in e.comms:
        lines.append(
            f"      {row.name:<36} {row.group:>12}={row.group_size:<4} {row.link:<5} {row.calls:>7} calls "
            f"{row.payload_bytes / 1e9:>9.2f} GB {row.time_s:>8.3f} s"
        )
    return lines


def _pipeline_line(e: Estimate, model: ModelSpec) -> str:
    """Why a pp shape costs what it does: the split, the micro-batches held, the bubble."""
    from ndparallel.estimate.pipeline import in_flight, rank_shares

    held = "; ".join(f"r{r}: {in_flight(e.mesh, e.microbatches, r)}" for r in range(e.mesh.pp))
    blocks = ", ".join(str(list(s.stage_blocks)) for s in rank_shares(model, e.mesh))
    return (
        f"      pipeline: {e.mesh.pp} ranks x {e.mesh.stages_per_rank} stage(s), {e.mesh.pp_schedule}, "
        f"m={e.microbatches}, bubble (p-1)/(v m+p-1) = {e.time.bubble:.1%}; blocks per stage by rank {blocks}; "
        f"micro-batches in flight per local stage {held}"
    )


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m ndparallel.estimate.cli ...`` (the same as ``ndparallel plan ...``)."""
    parser = argparse.ArgumentParser(prog="ndparallel")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
