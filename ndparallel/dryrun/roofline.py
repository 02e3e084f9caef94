"""The step's compute time from the trace: every op the rank ran, at the roofline of a GPU kind.

One op takes ``max(FLOPs / peak, bytes / HBM bandwidth)``: its FLOPs are torch's ``FlopCounterMode`` formulas
(the CPU flash-attention kernel a dry run dispatches is counted with the formula of the GPU's flash kernel, which
``FlopCounterMode`` has and the CPU one lacks), its bytes the sizes of the tensors it reads and writes (fake
tensors have shapes and dtypes). The tracker keeps a census of the measured step's ops, one row per distinct
(op, part, phase, FLOPs, bytes) with its calls, so any GPU kind can be priced afterwards (:func:`roofline_s`), and
split as the planner's overlap rules read compute (:func:`split_s`: forward, backward with its recompute, the
attention kernels among them, and what runs once per step).

What the roofline ignores, so its time is a floor: kernel launch overheads and the fixed cost of a small GEMM,
what real kernels reach of the data sheet (``estimate/kernels.py``'s ``GEMM_EFF``, ``HBM_EFF`` and a GPU's
``attention_eff`` are not applied), fusion (eager ops each read and write memory; a fused or compiled kernel
would not), overlap of compute with communication (the planner's rules add what stays exposed), every FLOP at
the GPU's bf16 dense peak whatever its dtype, and causal attention counted in full (torch's formula: a causal
flash kernel skips about half). docs/planning.md ("Dry run") has it measured against the planner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ndparallel.dryrun.torch_api import gpu_flop_formula

__all__ = [
    "ATTENTION_OPS",
    "NO_TRAFFIC",
    "OpCensus",
    "OpCount",
    "TraceSplit",
    "op_seconds",
    "roofline_s",
    "split_s",
    "tensor_bytes",
]

NO_TRAFFIC = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"})
"""aten ops that move no bytes: allocations (their output is written by the next op, counted there) and
``_unsafe_view`` (a reshape torch declares no view, of a tensor just made)."""

ATTENTION_OPS = frozenset(
    f"aten.{name}{suffix}"
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    for suffix in ("", "_backward")
) | {f"aten._{kind}_attention_{way}" for kind in ("flash", "efficient") for way in ("forward", "backward")}
"""The fused attention kernels, forward and backward: what the planner's attention term is (and what context
parallel's ring transfers hide behind). SDPA's math fallback decomposes into matmuls and a softmax, not counted
here."""


@dataclass(frozen=True)
class OpCount:
    """Calls of one op with one cost in the measured step: ``part`` is ``step`` (forward, backward, recompute,
    clipping) or ``optimizer`` (between an optimizer's step hooks); ``phase`` is ``forward`` or ``backward`` (in
    autograd's backward pass: recompute, FSDP's backward hooks included) for a micro-batch's ops, empty for the
    rest (clipping, the optimizer)."""

    op: str
    part: str
    flops: int
    bytes: int
    calls: int
    phase: str = ""


def op_seconds(flops: float, nbytes: float, peak_flops: float, hbm_bw: float) -> float:
    """One op at the roofline: the longer of its FLOPs at ``peak_flops`` and its bytes at ``hbm_bw``."""
    return max(flops / peak_flops, nbytes / hbm_bw)


def roofline_s(ops: Iterable[OpCount], peak_flops: float, hbm_bw: float, part: str | None = None) -> float:
    """Seconds of ``ops`` (of ``part`` only, when given), each call at the roofline."""
    return sum(o.calls * op_seconds(o.flops, o.bytes, peak_flops, hbm_bw) for o in ops if part in (None, o.part))


@dataclass(frozen=True)
class TraceSplit:
    """Roofline seconds of a step's ops as the planner's overlap rules read compute (``estimate/overlap.py``):
    totals over the step's micro-batches."""

    forward_s: float
    backward_s: float
    """Recompute included (it runs in backward), as in the planner's backward term."""
    attention_s: float
    """The attention kernels' share of the two (:data:`ATTENTION_OPS`)."""
    per_step_s: float
    """Once per step, after the micro-batches: clipping and the rest of the step outside them, the optimizer."""


def split_s(ops: Iterable[OpCount], peak_flops: float, hbm_bw: float) -> TraceSplit:
    """The roofline seconds of ``ops`` by phase (:class:`TraceSplit`)."""
    seconds = dict.fromkeys(("forward", "backward", "attention", "per_step"), 0.0)
    for o in ops:
        s = o.calls * op_seconds(o.flops, o.bytes, peak_flops, hbm_bw)
        phase = o.phase if o.part == "step" and o.phase in ("forward", "backward") else "per_step"
        seconds[phase] += s
        if phase != "per_step" and o.op in ATTENTION_OPS:
            seconds["attention"] += s
    return TraceSplit(seconds["forward"], seconds["backward"], seconds["attention"], seconds["per_step"])


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``tensor``: its elements, at most its storage (an expanded view)."""
    nbytes = tensor.numel() * tensor.element_size()
    try:
        return min(nbytes, tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses)
        return nbytes


class OpCensus:
    """The ops of a step, counted by (op, part, phase, FLOPs, bytes): few distinct rows, as every layer repeats."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str, int, int], int] = {}

    def clear(self) -> None:
        self.counts.clear()

    def add(
        self, func: Any, tensors: Iterable[Any], args: tuple, kwargs: dict, out: Any, part: str, phase: str = ""
    ) -> None:
        """Count one aten op (``tensors``: its inputs' and outputs' leaves); views, allocations and other
        namespaces' ops (collectives, the dispatcher's own) move nothing here."""
        if getattr(func, "namespace", "") != "aten" or getattr(func, "is_view", False):
            return
        name = func.overloadpacket.__name__
        if name in NO_TRAFFIC:
            return
        formula = gpu_flop_formula(func)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        nbytes = sum(tensor_bytes(t) for t in tensors if isinstance(t, torch.Tensor))
        key = (f"aten.{name}", part, phase, flops, nbytes)
        self.counts[key] = self.counts.get(key, 0) + 1

    def rows(self) -> list[OpCount]:
        return [
            OpCount(op, part, flops, nbytes, calls, phase)
            for (op, part, phase, flops, nbytes), calls in self.counts.items()
        ]
