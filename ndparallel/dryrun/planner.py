"""``ndparallel plan --dry-run``: the planner's top meshes, each also dry-run, the figures side by side.

For each of the top ranked shapes the job ``ndparallel train`` would run (the same parallelism config, batch,
sequence and model) is dry-run, and per pipeline rank the analytic figures (:mod:`ndparallel.estimate`) stand
beside the measured ones: parameter, gradient and optimizer bytes (which must be equal), the activation peak,
the peak, and the bytes each mesh dimension's collectives move (which should agree within 5%); and the step time
twice: the planner's, and the trace's, where every op the rank ran is priced at the GPU's roofline
(:mod:`ndparallel.dryrun.roofline`) in place of the planner's compute term, and the planner's overlap rules
(:func:`ndparallel.estimate.overlap.exposed_comm`) say what of the planner's communication that compute hides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ndparallel.dryrun.report import DryRunReport, RankReport
from ndparallel.dryrun.roofline import split_s
from ndparallel.dryrun.run import dry_run
from ndparallel.errors import ConfigError
from ndparallel.estimate import (
    ClusterSpec,
    Estimate,
    ModelSpec,
    TrainingSpec,
    activation_bytes,
    estimate_memory,
    saved_activation_bytes,
)
from ndparallel.estimate.comm import collectives
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.overlap import StepCompute, exposed_comm
from ndparallel.models import PRESETS, TransformerConfig
from ndparallel.models.transformer.family import FAMILY as TRANSFORMER_FAMILY
from ndparallel.train.job_config import DataConfig, LoopConfig, TrainConfig

__all__ = [
    "Side",
    "as_dry_run",
    "compare",
    "format_side_by_side",
    "job_of",
    "plan_dry_runs",
    "trace_compute",
    "trace_compute_s",
    "trace_step_s",
]

TOLERANCE = 0.05
"""Activation peak and collective bytes: analytic and dry run agree within this fraction (issue 46)."""

CONTROL_BYTES = 1 << 20
"""Collectives under this many bytes per dimension (clipping's agreement flags, the loss average, the pipeline's
shape exchange) are control traffic the planner does not model: shown, not held to the tolerance."""


def as_dry_run(train: TrainingSpec) -> TrainingSpec:
    """``train`` as the dry run runs it: eager (compiled kernels are not modelled: ``compile none``, no compiled
    loss) on CPU, where ``nn.RMSNorm`` is the composite op (fp32 copies saved), not CUDA's fused kernel. The
    planner's figures held to the dry run are of this spec (docs/planning.md, "Dry run")."""
    return dataclasses.replace(train, compile="none", compiled_loss=False, fused_norm=False)


def job_of(model: ModelSpec, train: TrainingSpec, mesh: MeshShape) -> TrainConfig:
    """The ``ndparallel train`` job of one planned shape (the reference Transformer of ``model``'s sizes)."""
    micro_batch = None if mesh.pp > 1 and mesh.pp_microbatches else train.micro_batch
    knobs = as_dry_run(train)
    return TrainConfig(
        parallelism=mesh.to_config(knobs),
        model=_transformer(model, train.seq_len),
        data=DataConfig(seq_len=train.seq_len),
        train=LoopConfig(
            global_batch=train.global_batch, micro_batch=micro_batch, defer_grad_sync=train.defer_grad_sync or None
        ),
    )


def _transformer(model: ModelSpec, seq_len: int) -> TransformerConfig:
    if model.name in PRESETS:
        return TransformerConfig.from_preset(model.name, max_seq_len=seq_len)
    if (
        model.family != TRANSFORMER_FAMILY.name  # the spec of another family (a Hugging Face config)
        or set(model.moe_layers) not in (set(), set(range(model.n_layers)))
        or model.tied_embeddings
        or model.head_dim * model.n_heads != model.dim
    ):
        raise ConfigError(
            f"plan --dry-run builds the reference Transformer of the planned sizes; {model.name} is not one (a "
            "Hugging Face MoE, dense layers among MoE ones, tied embeddings or its own head width): dry-run its "
            "config with `ndparallel dry-run --model CONFIG --world N`"
        )
    experts = {}
    if model.is_moe:
        shared = model.shared_ffn_dim // model.expert_ffn_dim if model.shared_ffn_dim else 0
        experts = dict(n_experts=model.n_experts, top_k=model.top_k, expert_ffn_dim=model.expert_ffn_dim,
                       n_shared_experts=shared)  # fmt: skip
    return TransformerConfig(
        vocab_size=model.vocab_size, dim=model.dim, n_layers=model.n_layers, n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim, max_seq_len=seq_len, **experts,
    )  # fmt: skip


@dataclass
class Side:
    """One pipeline rank of one shape: analytic and measured figures (bytes), and the collectives per dim."""

    shape: str
    rank: RankReport
    analytic: dict[str, float]
    measured: dict[str, float]
    comm: dict[str, tuple[float, float]] = field(default_factory=dict)
    """dim -> (analytic bytes, measured bytes) over the step."""
    flops: tuple[float, float] = (0.0, 0.0)
    """(the planner's model FLOPs per rank: the step's ``6 N`` + attention over the world, no recompute; the FLOPs
    the dry run traced on this rank, recompute included)."""
    compute_s: tuple[float, float] = (0.0, 0.0)
    """(the planner's compute seconds, bubble included; the trace's: :func:`trace_compute_s`, a floor)."""
    step_s: tuple[float, float] = (0.0, 0.0)
    """(the planner's step seconds; the trace's: :func:`trace_step_s`, its compute + the planner's communication
    that the overlap rules leave exposed against it)."""

    def disagreements(self) -> list[str]:
        """What breaks the rule: state bytes equal, activations and collective bytes within 5%."""
        bad = [k for k in ("params", "grads", "optimizer") if round(self.analytic[k]) != self.measured[k]]
        if not _close(self.analytic["activations"], self.measured["activations"]):
            bad.append("activations")
        for dim, (a, m) in self.comm.items():
            if max(a, m) >= CONTROL_BYTES and not _close(a, m):
                bad.append(f"{dim} bytes")
        return bad


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1.0)


def trace_compute(e: Estimate, rank: RankReport, hbm_bw: float) -> StepCompute:
    """The rank's compute from its trace as the overlap rules read it: its ops at the roofline of ``e``'s GPU peak
    and ``hbm_bw``, by phase (:func:`ndparallel.dryrun.roofline.split_s`)."""
    split = split_s(rank.ops, e.time.peak_flops, hbm_bw)
    return StepCompute(split.forward_s, split.backward_s, split.attention_s, split.per_step_s)


def trace_compute_s(e: Estimate, rank: RankReport, hbm_bw: float) -> float:
    """The rank's compute seconds from its trace: its micro-batches' ops stretched by the planner's pipeline bubble
    as the planner stretches its own, plus the ops once per step (clipping, the optimizer)."""
    return trace_compute(e, rank, hbm_bw).total_s(e.time.bubble)


def trace_step_s(e: Estimate, train: TrainingSpec, rank: RankReport, hbm_bw: float) -> float:
    """The rank's step seconds from its trace: :func:`trace_compute_s` + the planner's collectives that the
    planner's overlap rules leave exposed against the trace's compute (not against the planner's)."""
    compute = trace_compute(e, rank, hbm_bw)
    return compute.total_s(e.time.bubble) + sum(exposed_comm(compute, e.comms, e.mesh, train).values())


def compare(
    e: Estimate, model: ModelSpec, train: TrainingSpec, report: DryRunReport, cluster: ClusterSpec | None = None
) -> list[Side]:
    """Each measured rank beside the analytic figures of its pipeline rank (``cluster``: the GPU's HBM bandwidth
    for the trace's roofline; default the planner's default GPU)."""
    hbm_bw = (cluster or ClusterSpec()).hbm_bw
    sides = []
    for r in report.ranks:
        pp_rank = r.coordinate.get("pp", 0)
        mem = estimate_memory(model, train, e.mesh, pp_rank if e.mesh.pp > 1 else None)
        # what autograd saves (the dry run counts saved tensors), not the loss's live logits and their gradient,
        # for the job as the dry run runs it (eager, the CPU's composite RMSNorm)
        ran = as_dry_run(train)
        if e.mesh.pp > 1:
            saved = saved_activation_bytes(model, ran, e.mesh, pp_rank, saved_only=True)
        else:
            saved = activation_bytes(model, ran, e.mesh, saved_only=True)
        analytic = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                    "activations": saved, "peak": mem.peak}  # fmt: skip
        state = r.state_bytes
        measured = {
            "params": state["params"],
            "grads": state["grads"],
            "optimizer": state["optimizer"] - state["optimizer_step_counters"],
            "activations": r.activation_peak_bytes - r.retained_activation_bytes,
            "peak": r.peak_bytes,
        }
        comm: dict[str, list[float]] = {}
        # under pp, this pp rank's collectives (e.comms are the pp rank whose communication takes longest)
        rows = collectives(model, train, e.mesh, cluster or ClusterSpec(), pp_rank) if e.mesh.pp > 1 else e.comms
        for row in rows:
            comm.setdefault(_dim(row.group, e.mesh), [0.0, 0.0])[0] += row.payload_bytes
        for row in r.comms:
            comm.setdefault(_dim(row.dim, e.mesh), [0.0, 0.0])[1] += row.bytes
        side = Side(e.mesh.describe(), r, analytic, measured, {k: (a, m) for k, (a, m) in comm.items()})
        side.flops = (e.time.model_flops_per_step / e.mesh.world_size, float(r.flops))
        side.compute_s = (e.time.compute_s, trace_compute_s(e, r, hbm_bw))
        side.step_s = (e.time.step_s, trace_step_s(e, train, r, hbm_bw))
        sides.append(side)
    return sides


def _dim(name: str, mesh: MeshShape) -> str:
    """One name per process group: the dry run names FSDP's group ``dp_shard`` when cp is 1 (the same ranks), and
    ep's after dp_shard or cp when ep spans all of dp_shard x cp (``ep_fsdp`` 1)."""
    if name == "ep" and mesh.ep == mesh.dp_shard * mesh.cp:
        name = "dp_shard_cp"
    if name == "dp_shard":
        name = "dp_shard_cp"
    if name == "dp_shard_cp" and mesh.dp_shard == 1 and mesh.cp > 1:
        name = "cp"
    return name


def plan_dry_runs(result: Any, top: int, progress=None) -> list[Side]:  # noqa: ANN001
    """Dry-run the ``top`` ranked shapes of a :class:`ndparallel.estimate.Plan`; every rank beside its analytic."""
    sides = []
    for e in result.ranked[:top]:
        cfg = job_of(result.model, result.train, e.mesh)
        report = dry_run(cfg, e.mesh.world_size, progress=progress)
        sides += compare(e, result.model, result.train, report, result.cluster)
    return sides


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def format_side_by_side(sides: list[Side]) -> str:
    """Per shape and pp rank: each figure as analytic | dry run (GiB; collectives in GB), and what disagrees."""
    lines = [
        "dry run beside the plan (analytic | dry run; GiB; state must be equal, activations and collectives within "
        "5%; collectives under 1 MiB are control traffic, not modelled; TFLOP: the model's 6N per rank | traced, "
        "recompute included; compute s: the plan's | the trace's ops at the GPU's roofline, a floor; step s: the "
        "plan's | the trace's compute + the plan's communication its overlap rules leave exposed against it):",
        f"{'mesh':<34} {'rank':>6} {'params':>13} {'grads':>13} {'optimizer':>13} {'activations':>13} "
        f"{'peak':>13} {'TFLOP':>11} {'compute s':>17} {'step s':>17}  collectives GB by dim",
    ]
    for s in sides:
        cells = [f"{_gib(s.analytic[k])}|{_gib(s.measured[k])}" for k in ("params", "grads", "optimizer",
                                                                          "activations", "peak")]  # fmt: skip
        comm = ", ".join(f"{d} {a / 1e9:.2f}|{m / 1e9:.2f}" for d, (a, m) in sorted(s.comm.items()))
        bad = s.disagreements()
        flops = f"{s.flops[0] / 1e12:.0f}|{s.flops[1] / 1e12:.0f}"
        seconds = f"{s.compute_s[0]:.3g}|{s.compute_s[1]:.3g}"
        step = f"{s.step_s[0]:.3g}|{s.step_s[1]:.3g}"
        lines.append(
            f"{s.shape:<34} {s.rank.rank:>6} "
            + " ".join(f"{c:>13}" for c in cells)
            + f" {flops:>11} {seconds:>17} {step:>17}  {comm}"
            + (f"  DIFFERS: {', '.join(bad)}" if bad else "")
        )
    return "\n".join(lines)
