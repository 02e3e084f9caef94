"""Tolerances, the per-layout comparison and the verdict table of ``ndparallel verify``.

Only bounds this repository measured are used, each with where it comes from; a case without one is shown
as measured but not judged ("no measured bound"), never held to an invented number:

* float64: 1e-10 on everything, the exactness bound of the parity tests (measured ~1e-15; tests/parity.py
  FLOAT64_TOL, docs/parallelize.md#numerical-guarantees). A model that computes some ops in fp32 inside (an
  HF RMSNorm, Gemma's norms) has a round-off floor above float64's: :func:`float64_tolerance` measures it.
* float32: loss 1e-4, grad norm 1e-4 relative, step-1 gradients 1e-6 (the fp32 smoke bound,
  tests/parallel/test_fp32_smoke.py via tests/parity.py FP32_TOL); parameters after N steps: no measured bound.
* bf16 (fp32 parameters, bf16 compute): loss 2e-3, norm 1e-2, gradients 2e-3 against the fp32 reference,
  measured on FSDP (tests/parallel/test_parallelize.py BF16_TOL, dp_shard4): only dp_shard layouts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ndparallel.verify.layouts import Layout
from ndparallel.verify.run import Trace

__all__ = [
    "METRICS",
    "Row",
    "Tolerance",
    "VerifyTable",
    "compare",
    "describe_shrink",
    "float64_tolerance",
    "tolerance_for",
]

METRICS = ("loss", "grad_norm", "grad", "param")
FLOAT64_BOUND = 1e-10
FLOOR_LIMIT = 1e-12  # a float64 floor above this is not float64 round-off: the tolerance follows it
SPLIT_LIMIT = 1e-4  # ... up to fp32 round-off (the fp32 smoke loss bound); beyond, the split changed the math
_TOLERANCES_DOC = "docs/verify.md#tolerances-only-measured-bounds"  # where each bound was measured
_FP64_SOURCE = f"float64 exactness bound ({_TOLERANCES_DOC})"
_FP32_SOURCE = f"fp32 bound measured on this project's models ({_TOLERANCES_DOC})"
_BF16_SOURCE = f"bf16 FSDP bound measured on dp_shard 4 ({_TOLERANCES_DOC})"


@dataclass(frozen=True)
class Tolerance:
    """A bound per metric (None: no measured bound, not judged) and where the numbers come from."""

    loss: float | None
    grad_norm: float | None  # relative
    grad: float | None
    param: float | None
    source: str


def float64_tolerance(floor: float, routed: bool = False) -> Tolerance:
    """1e-10, or 10x the measured floor (the reference against itself on two accumulated halves) when that
    floor is above 1e-12 and 10x of it above 1e-10: the model rounds to fp32 somewhere inside, the same on
    every mesh. A floor beyond fp32 round-off (:data:`SPLIT_LIMIT`) is no round-off: the model's result
    depends on how the batch is split (a per-batch statistic), which data parallel cannot reproduce, so the
    bound stays 1e-10 and the dp layouts fail. ``routed``: the model has auxiliary losses (an MoE's balancing
    loss, a per-batch statistic by design, which ndparallel computes on the global batch): said so instead."""
    if floor > SPLIT_LIMIT:
        why = (
            "an MoE's balancing loss uses the token fractions of the batch; ndparallel counts them over every "
            "data rank, so each layout must still match one process"
            if routed
            else "a per-batch statistic (BatchNorm-style mean over the batch) is not data-parallel safe"
        )
        source = (
            f"{_FP64_SOURCE}; the model's result depends on how the batch is split ({floor:.1e} between one batch "
            f"and two accumulated halves, beyond fp32 round-off {SPLIT_LIMIT:.0e}): {why}"
        )
        return Tolerance(FLOAT64_BOUND, FLOAT64_BOUND, FLOAT64_BOUND, FLOAT64_BOUND, source)
    if floor > FLOOR_LIMIT and 10 * floor > FLOAT64_BOUND:
        bound = 10 * floor
        source = f"10x the model's own float64 floor {floor:.1e} (reference vs two accumulated halves)"
    else:
        bound = FLOAT64_BOUND
        source = f"{_FP64_SOURCE}; model floor {floor:.1e}"
    return Tolerance(bound, bound, bound, bound, source)


def tolerance_for(dtype: str, layout: Layout, float64: Tolerance | None = None) -> Tolerance:
    """The bound a layout is held to in ``dtype``."""
    if dtype == "float64":
        return float64 or float64_tolerance(0.0)
    if dtype == "float32":
        return Tolerance(1e-4, 1e-4, 1e-6, None, _FP32_SOURCE)
    if {d for d, _ in layout.sizes} == {"dp_shard"}:
        return Tolerance(2e-3, 1e-2, 2e-3, None, _BF16_SOURCE)
    return Tolerance(None, None, None, None, f"no measured bound for bf16 on {layout.name}")


def errors(got: Trace, ref: Trace) -> dict[str, float]:
    """max |dloss|, max relative |dgrad-norm|, max |d step-1 gradient|, max |dparam| after the last step."""

    def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
        if a.keys() != b.keys():
            return math.inf  # a parameter missing or extra: not the same model
        return max((float(np.abs(a[k] - b[k]).max()) for k in b), default=0.0)

    return {
        "loss": max(abs(x - y) for x, y in zip(got.losses, ref.losses, strict=True)),
        "grad_norm": max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(got.grad_norms, ref.grad_norms, strict=True)),
        "grad": max_diff(got.grads, ref.grads),
        "param": max_diff(got.params, ref.params),
    }


@dataclass
class Row:
    layout: str
    ranks: int
    verdict: str  # pass | FAIL | unjudged | refused | error
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    localized: dict[str, Any] | None = None


def compare(layout: Layout, got: Trace, ref: Trace, tol: Tolerance) -> Row:
    """One layout's row: the errors against the reference and the verdict under ``tol``."""
    if got.refused:
        return Row(layout.name, layout.ranks, "refused", message=got.refused)
    if got.error:
        return Row(layout.name, layout.ranks, "error", message=got.error)
    errs = errors(got, ref)
    judged = {m: getattr(tol, m) for m in METRICS if getattr(tol, m) is not None}
    over = [m for m, bound in judged.items() if not errs[m] <= bound]  # NaN fails too
    verdict = "FAIL" if over else ("pass" if judged else "unjudged")
    unjudged = [m for m in METRICS if m not in judged]
    if over:
        message = f"beyond tolerance: {', '.join(over)}"
    elif not judged:
        message = "no measured bound"
    else:
        message = f"{', '.join(unjudged)} not judged: no measured bound" if unjudged else ""
    return Row(layout.name, layout.ranks, verdict, errs, asdict(tol), message)


@dataclass
class VerifyTable:
    """What ``verify`` found: one row per layout, and the reference's own checks."""

    model: str
    dtype: str
    steps: int
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    shrunk: dict[str, list[Any]] | None = None  # --shrink: {field: [from, to]}; None: the model as given

    @property
    def ok(self) -> bool:
        """No failure or error, and at least one layout was not refused."""
        verdicts = [r.verdict for r in self.rows]
        return not {"FAIL", "error"} & set(verdicts) and any(v != "refused" for v in verdicts)

    def format(self) -> str:
        header = ("layout", "ranks", "max |dloss|", "max |dnorm| rel", "step-1 |dgrad|", "max |dparam|", "tolerance")
        lines = [_cells(header)]
        for row in self.rows:
            if row.verdict in ("refused", "error"):
                lines.append(_cells((row.layout, str(row.ranks))) + f"  {row.verdict}: {row.message}")
                continue
            bound = row.tolerance.get("loss")
            cells = [row.layout, str(row.ranks), *(_num(row.errors[m]) for m in METRICS)]
            cells.append("none" if bound is None else f"{bound:.0e}")
            verdict = row.verdict + (f" ({row.message})" if row.message else "")
            lines.append(_cells(cells) + f"  {verdict}")
            if row.localized:
                lines.append(f"    first divergence: {row.localized['summary']}")
        sources = dict.fromkeys(r.tolerance["source"] for r in self.rows if r.tolerance)
        lines += [f"tolerance: {s}" for s in sources] + self.notes
        if self.shrunk is not None:
            lines.append(
                f"shrunk (--shrink; the architecture kept, not the job's sizes): {describe_shrink(self.shrunk)}"
            )
        all_refused = bool(self.rows) and all(r.verdict == "refused" for r in self.rows)
        lines.append(
            f"verdict: {'PASS' if self.ok else 'FAIL'}" + (" (every layout was refused)" if all_refused else "")
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)


def describe_shrink(changes: dict[str, Any]) -> str:
    """``num_hidden_layers 80 -> 2, hidden_size 8192 -> 32, ...``; a list as its length and, up to 4 of them,
    its distinct entries (``layer_types [26 entries: sliding_attention, full_attention] -> [2 entries: ...]``
    shows the shrink kept a layer of each kind)."""

    def show(value: Any) -> str:
        if not isinstance(value, (list, tuple)):
            return str(value)
        kinds = list(dict.fromkeys(map(str, value)))
        return f"[{len(value)} entries: {', '.join(kinds)}]" if len(kinds) <= 4 else f"[{len(value)} entries]"

    if not changes:
        return "nothing changed (already at tiny sizes)"
    return ", ".join(f"{name} {show(old)} -> {show(new)}" for name, (old, new) in changes.items())


def _num(value: float) -> str:
    return f"{value:.1e}"


def _cells(cells: Sequence[str]) -> str:
    widths = (26, 5, 11, 15, 14, 12, 9)
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()
