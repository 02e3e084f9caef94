"""The overlap rules: which communication of a step its compute hides, and which stays exposed.

One function, :func:`exposed_comm`, read by the planner's step time (``timing``, on the planner's compute) and by
``plan --dry-run`` (on the compute the dry run traced, ``dryrun/planner.py``): one rule, whatever the compute.
Assumptions (FSDP2 prefetching, overlapped gradient reduction, no async TP):

* FSDP forward all-gathers hide behind forward compute, except the first unit's of each micro-batch.
* Backward all-gathers hide behind the micro-batch's backward compute (+ recompute); gradient
  reductions (reduce-scatter, HSDP / replicate all-reduce) hide behind the backward of the
  micro-batch that syncs, except the last unit's reduction.
* TP/SP collectives sit on the critical path: fully exposed.
* CP ring K/V transfers hide behind attention compute (forward, backward and recompute); the
  allgather and alltoall (Ulysses) collectives run before or after the attention that needs them:
  fully exposed.
* Mixture of experts: the all-to-alls of routed tokens and the router's statistics sit between the router and
  the experts (the experts wait for their rows, the block's output for the rows coming back): fully exposed.
  The experts' own FSDP units overlap like any other unit.
* Pipeline parallel: each rank computes its stages' share of the FLOPs (the slowest rank sets the pace),
  stretched by the schedule's bubble, ``compute / (1 - bubble)``; the point-to-point sends of the fill and
  the drain (``2 (p - 1)`` of one micro-batch) are exposed, the others overlap the next micro-batch. Pure
  replicate under pp all-reduces the gradients after the schedule: exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.estimate.comm import Collective
from ndparallel.estimate.memory import pipeline_train
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.training import TrainingSpec

__all__ = ["StepCompute", "exposed_comm"]


@dataclass(frozen=True)
class StepCompute:
    """One rank's compute seconds in an optimizer step, as the overlap rules read it: totals over the step's
    micro-batches (the planner's per micro-batch terms times their number), before the pipeline bubble."""

    forward_s: float
    backward_s: float
    """Recompute included (it runs in backward)."""
    attention_s: float
    """The attention kernels' share of forward and backward (recompute included): what cp's ring hides behind."""
    per_step_s: float = 0.0
    """Once per step, after the micro-batches (the optimizer): not stretched by the bubble, hides nothing."""

    def total_s(self, bubble: float) -> float:
        """Compute seconds of the step: the micro-batches' stretched by the pipeline ``bubble``, + the per-step."""
        return (self.forward_s + self.backward_s) / (1 - bubble) + self.per_step_s


def exposed_comm(
    compute: StepCompute, comms: list[Collective], mesh: MeshShape, train: TrainingSpec
) -> dict[str, float]:
    """Seconds of ``comms`` that ``compute`` does not hide, per phase (module docstring: the rules); phases with
    nothing exposed are left out."""
    train = pipeline_train(train, mesh)
    micro_steps = train.accumulation_steps(mesh) or 1
    by_phase: dict[str, list[Collective]] = {}
    for row in comms:
        by_phase.setdefault(row.phase, []).append(row)

    def total(phase: str) -> float:
        return sum(row.time_s for row in by_phase.get(phase, []))

    def first_calls(phase: str, count: int) -> float:
        """What cannot overlap: one call per micro-batch (first gather)."""
        return sum(row.time_s / row.calls for row in by_phase.get(phase, [])) * count

    # Backward of each micro-batch hides its re-gathers and its gradient reductions: a reduce-scatter on each
    # micro-batch that reduce-scatters (all of them under FSDP unless deferred), the all-reduces (HSDP,
    # replicate) on the last. The last reduction of the step cannot overlap.
    # under pp the schedule gathers each FSDP unit and reduce-scatters its gradient once per step
    rs_steps = 1 if mesh.pp > 1 else train.reduce_scatter_steps(mesh)
    gathers = 1 if mesh.pp > 1 else micro_steps
    scatter = [row for row in by_phase.get("grad_reduce", []) if row.kind == "reduce_scatter"]
    all_reduce = [row for row in by_phase.get("grad_reduce", []) if row.kind != "reduce_scatter"]
    scatter_per_sync = sum(row.time_s for row in scatter) / rs_steps
    regather, backward = total("fsdp_backward") / micro_steps, compute.backward_s / micro_steps
    scattering = scatter_per_sync if rs_steps == micro_steps else 0.0  # on the micro-batches before the last
    backward_exposed = (micro_steps - 1) * max(0.0, regather + scattering - backward)
    backward_exposed += max(0.0, regather + scatter_per_sync + sum(row.time_s for row in all_reduce) - backward)
    last_calls = sum(row.time_s / row.calls for row in scatter) * rs_steps + sum(
        row.time_s / row.calls for row in all_reduce
    )
    pp_sends = [row.time_s / row.calls for row in by_phase.get("pp", [])]
    exposed = {
        "pp": 2 * (mesh.pp - 1) * max(pp_sends, default=0.0),
        "fsdp_forward": max(0.0, total("fsdp_forward") - compute.forward_s) + first_calls("fsdp_forward", gathers),
        "backward": backward_exposed + last_calls,
        "tp": total("tp"),
        "cp_ring": max(0.0, total("cp_ring") - compute.attention_s),
        "cp": total("cp"),
        "ep": total("ep"),
        "loss": total("loss"),
        "after_schedule": total("after_schedule"),
    }
    return {k: v for k, v in exposed.items() if v > 0}
