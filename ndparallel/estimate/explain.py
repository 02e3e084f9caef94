"""``ndparallel plan --explain``: one shape's step time, taken apart: compute by kind, the pipeline bubble and the
communication compute does not hide, by mesh dim."""

from __future__ import annotations

from ndparallel.estimate.search import Estimate

__all__ = ["EXPOSED_BY_DIM", "breakdown", "format_explain"]

EXPOSED_BY_DIM = {
    "fsdp_forward": "dp_shard x cp: FSDP forward all-gathers (the first unit's of each micro-batch)",
    "backward": "dp_shard x cp / dp_replicate: backward re-gathers + gradient reduction (the last unit's)",
    "tp": "tp: sequence-parallel all-gathers / reduce-scatters, norm + loss all-reduces (not overlapped)",
    "cp_ring": "cp: ring K/V transfers attention did not hide",
    "cp": "cp: all-gather / all-to-all attention (not overlapped)",
    "ep": "ep / dp x cp: all-to-all of routed tokens and expert counts, router statistics (not overlapped)",
    "pp": "pp: fill and drain sends",
    "loss": "pp: the step's loss reduction and broadcast",
    "after_schedule": "dp_replicate: gradient all-reduce after the pipeline schedule",
}
"""What each exposed phase of ``timing`` is, named by the mesh dim it runs over."""


def breakdown(e: Estimate) -> list[tuple[str, str, float]]:
    """(part, what, seconds per step) rows; they sum to ``e.time.step_s``."""
    t = e.time
    rows = [("compute", kind, seconds) for kind, seconds in t.compute_by_kind.items() if seconds > 0]
    if t.bubble_s > 0:
        rows.append(("bubble", f"pipeline {e.mesh.pp_schedule}: {t.bubble:.1%} of compute idle", t.bubble_s))
    rows += [("exposed comm", EXPOSED_BY_DIM.get(phase, phase), s) for phase, s in t.exposed_s.items()]
    return rows


def format_explain(e: Estimate) -> str:
    """The breakdown as a table, with each row's share of the step."""
    t, rows = e.time, breakdown(e)
    total = "= compute + bubble + exposed comm"
    width = max(len(total), *(len(what) for _, what, _ in rows))
    lines = [
        f"step-time breakdown of {e.mesh.describe()} (per optimizer step, one GPU):",
        f"  {'part':<13} {'what':<{width}} {'seconds':>9} {'share':>6}",
    ]
    for part, what, seconds in rows:
        lines.append(f"  {part:<13} {what:<{width}} {seconds:>9.4f} {seconds / t.step_s:>6.1%}")
    lines.append(
        f"  {'step':<13} {total:<{width}} {t.step_s:>9.4f} {1:>6.0%}   "
        f"-> {t.tokens_per_s / t.world_size:,.0f} tok/s per GPU, MFU {t.mfu:.1%}"
    )
    return "\n".join(lines)
