"""What a dry run found, per rank and for the job: dataclasses, the text report, the table and JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ndparallel.dryrun.roofline import OpCount, roofline_s
from ndparallel.estimate.hardware import GPU_KINDS

__all__ = ["LIMITS", "CommRow", "DryRunReport", "RankReport", "format_report", "format_table"]

GiB = 2**30

LIMITS = (
    "fake tensors carry no values: no numerics are checked (that is `ndparallel verify`)",
    "not modelled: NCCL's buffers, the CUDA caching allocator's rounding and fragmentation, fused or compiled "
    "kernels' savings; no allowance is added for them",
    "mixture of experts: routing is balanced (every expert gets the same tokens)",
    "compute at the roofline: every traced op at max(FLOPs / bf16 dense peak, bytes / HBM bandwidth) of the "
    "GPU's data sheet, a floor: no launch overheads, no kernel efficiency below the data sheet, no fusion, no "
    "overlap, causal attention counted in full",
)
"""Printed with every report; docs/planning.md ("Dry run") says more."""


@dataclass
class CommRow:
    """The collectives of one kind over one mesh dimension in the measured step."""

    dim: str
    kind: str
    group_size: int
    calls: int
    bytes: int


@dataclass
class RankReport:
    """One rank's measured step."""

    rank: int
    coordinate: dict[str, int]
    stage_ids: list[int]
    peak_bytes: int
    peak_by_kind: dict[str, int]
    state_bytes: dict[str, int]
    """Parameter, gradient and optimizer bytes when the optimizer steps (every gradient there); of the optimizer's,
    ``optimizer_step_counters`` are AdamW's per-parameter step scalars."""
    peak_module: str
    peak_phase: str
    activation_peak_bytes: int
    """The most bytes autograd held saved for backward at once (with the retained ones)."""
    retained_activation_bytes: int
    """Of them, saved before the measured step began and still held: under pp, torch 2.13's first stage keeps
    the saved tensors of its shape-inference forward (one micro-batch) from the first step on."""
    flops: int
    comms: list[CommRow]
    accumulation: int
    local_batch: int
    stand_in_values: int = 0
    """How many values read off fake tensors were answered with a healthy step's stand-in."""
    seconds: float = 0.0
    uneven_shards: bool = False
    """Some parameter's shards differ in size across its shard group (then the last shard rank is measured too)."""
    ops: list[OpCount] = field(default_factory=list)
    """The measured step's ops, counted by cost (:mod:`ndparallel.dryrun.roofline`)."""

    def roofline_s(self, peak_flops: float, hbm_bw: float, part: str | None = None) -> float:
        """Seconds of the measured step's ops (of ``part``: ``step`` or ``optimizer``) at a GPU's roofline."""
        return roofline_s(self.ops, peak_flops, hbm_bw, part)

    def comm_bytes(self, dim: str | None = None) -> int:
        return sum(r.bytes for r in self.comms if dim is None or r.dim == dim)

    def where(self) -> str:
        coordinate = ", ".join(f"{k} {v}" for k, v in self.coordinate.items() if k != "ep" or v)
        stages = f", stages {self.stage_ids}" if self.stage_ids else ""
        return f"rank {self.rank} ({coordinate}{stages})"


@dataclass
class DryRunReport:
    """The job's ranks that differ, each measured."""

    world: int
    mesh: str
    model: str
    ranks: list[RankReport] = field(default_factory=list)
    gpu_memory: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    gpu: str = "h100"
    """The GPU kind (``estimate/hardware.py``) whose roofline prices the traced ops in the report."""

    def roofline_s(self, rank: RankReport, part: str | None = None) -> float:
        """``rank``'s measured ops (of ``part``) at the roofline of this report's GPU kind."""
        kind = GPU_KINDS[self.gpu]
        return rank.roofline_s(kind.peak_flops, kind.hbm_bw, part)

    @property
    def worst(self) -> RankReport:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    def out_of_memory(self) -> str | None:
        """The OOM a ``gpu_memory`` would see, naming rank, phase and module; None when every rank fits."""
        if not self.gpu_memory or self.worst.peak_bytes <= self.gpu_memory:
            return None
        r = self.worst
        return (
            f"{r.where()} needs {r.peak_bytes / GiB:.2f} GiB at its peak, over the {self.gpu_memory / GiB:.2f} GiB "
            f"per GPU: in {r.peak_phase}, module {r.peak_module or '(none)'}; "
            "lower the micro-batch, add activation checkpointing, or shard more (dp_shard, tp, pp)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "limits": list(LIMITS), "out_of_memory": self.out_of_memory()}


def _gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def format_table(report: DryRunReport) -> str:
    """One row per rank: peak and its parts (GiB), TFLOPs, communicated GB."""
    head = (
        f"{'rank':>6} {'coordinate':<34} {'peak':>7} {'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} "
        f"{'temp':>7} {'TFLOP':>8} {'comm GB':>8}"
    )
    rows = [head]
    for r in report.ranks:
        k = r.peak_by_kind
        coordinate = " ".join(f"{d}{v}" for d, v in r.coordinate.items())
        rows.append(
            f"{r.rank:>6} {coordinate:<34} {_gib(r.peak_bytes):>7} {_gib(k['params']):>7} {_gib(k['grads']):>7} "
            f"{_gib(k['optimizer']):>7} {_gib(k['activations']):>7} "
            f"{_gib(k['temporaries'] + k['unsharded_params']):>7} {r.flops / 1e12:>8.1f} {r.comm_bytes() / 1e9:>8.2f}"
        )
    return "\n".join(rows)


def format_report(report: DryRunReport) -> str:
    """The text report: header, the table, then per rank the peak's place and its collectives, then the limits."""
    lines = [
        f"dry run: {report.model} on {report.world} ranks, mesh {report.mesh}; {len(report.ranks)} rank(s) that "
        f"differ measured in {report.seconds:.1f} s (one process, fake tensors and process group)",
        "",
        "per-rank peak and its parts at the peak (GiB; temp = unsharded parameters + temporaries), measured step:",
        format_table(report),
    ]
    for r in report.ranks:
        lines += [
            "",
            f"{r.where()}: peak {_gib(r.peak_bytes)} GiB in {r.peak_phase}, module {r.peak_module or '(none)'}; "
            f"activations at most {_gib(r.activation_peak_bytes)} GiB"
            + (
                f" ({_gib(r.retained_activation_bytes)} GiB held since an earlier step)"
                if r.retained_activation_bytes
                else ""
            )
            + f"; {r.accumulation} micro-batch(es) of "
            f"{r.local_batch // max(1, r.accumulation)} sequence(s); {r.flops / 1e12:.2f} TFLOP per step; "
            f"its ops at the {report.gpu} roofline {report.roofline_s(r, 'step') * 1e3:.3g} ms + optimizer "
            f"{report.roofline_s(r, 'optimizer') * 1e3:.3g} ms",
        ]
        for c in r.comms:
            lines.append(
                f"    {c.dim:<13} {c.kind:<15} group {c.group_size:>6} {c.calls:>7} calls {c.bytes / 1e9:>10.3f} GB"
            )
    oom = report.out_of_memory()
    if report.gpu_memory:
        lines += ["", f"OUT OF MEMORY: {oom}" if oom else f"fits: every rank under {_gib(report.gpu_memory)} GiB"]
    lines += ["", *[f"note: {n}" for n in report.notes], *[f"limit: {text}" for text in LIMITS]]
    return "\n".join(lines)
