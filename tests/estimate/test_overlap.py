"""The overlap rules (estimate/overlap.py): one function, read by the planner's step time on its own compute and by
``plan --dry-run`` on the trace's. Analytic, no ranks."""

from __future__ import annotations

import dataclasses

import pytest

from ndparallel.estimate import ClusterSpec, TrainingSpec, model_spec
from ndparallel.estimate.compute import compute_time
from ndparallel.estimate.memory import pipeline_train
from ndparallel.estimate.overlap import StepCompute, exposed_comm
from ndparallel.estimate.search import plan

PLANS = {
    "8b fsdp/tp/hsdp, accumulation": ("8b", TrainingSpec(seq_len=4096, global_batch=64, micro_batch=1), 16, False),
    "8b cp ring, full checkpointing": (
        "8b", TrainingSpec(seq_len=32768, global_batch=16, activation_checkpointing="full"), 64, False,
    ),
    "70b pp": ("70b", TrainingSpec(seq_len=4096, global_batch=128, defer_grad_sync=True), 64, True),
    "tiny-moe ep": ("tiny-moe", TrainingSpec(seq_len=512, global_batch=32), 8, False),
}  # fmt: skip


def _planner_compute(model, train, mesh, cluster) -> StepCompute:  # noqa: ANN001
    """The planner's compute as ``estimate_step_time`` hands it to the rules: totals over the micro-batches."""
    train = pipeline_train(train, mesh)
    micro_steps = train.accumulation_steps(mesh) or 1
    parts = compute_time(model, train, mesh, cluster)
    attention = micro_steps * (parts.attention_forward + parts.attention_backward)
    per_step = sum(parts.per_step.values())
    return StepCompute(micro_steps * parts.forward_s, micro_steps * parts.backward_s, attention, per_step)


@pytest.mark.parametrize("case", PLANS)
def test_the_rules_on_the_planners_compute_are_its_step_time(case):
    name, train, gpus, search_pp = PLANS[case]
    model, cluster = model_spec(name), ClusterSpec(num_gpus=gpus)
    result = plan(model, train, cluster, search_pp=search_pp)
    estimates = result.ranked[:40] + result.rejected[:20]
    assert estimates
    phases = set()
    for e in estimates:
        compute = _planner_compute(model, train, e.mesh, cluster)
        exposed = exposed_comm(compute, e.comms, e.mesh, train)
        assert exposed == e.time.exposed_s, e.mesh.describe()  # exactly: one rule, one place
        assert compute.total_s(e.time.bubble) == e.time.compute_s
        phases |= set(exposed)
    assert {"fsdp_forward", "backward"} <= phases


def test_less_compute_hides_less():
    model, train, cluster = model_spec("8b"), TrainingSpec(seq_len=32768, global_batch=16), ClusterSpec(num_gpus=64)
    e = next(e for e in plan(model, train, cluster).ranked if e.mesh.cp > 1 and e.mesh.dp_shard > 1)
    compute = _planner_compute(model, train, e.mesh, cluster)
    base = exposed_comm(compute, e.comms, e.mesh, train)
    assert "cp_ring" not in base  # the planner's attention hides the ring
    fast = dataclasses.replace(
        compute, forward_s=compute.forward_s / 100, backward_s=compute.backward_s / 100,
        attention_s=compute.attention_s / 100,
    )  # fmt: skip
    more = exposed_comm(fast, e.comms, e.mesh, train)
    for phase in ("fsdp_forward", "backward", "cp_ring"):
        assert more[phase] > base.get(phase, 0.0), phase
    # what no compute hides stays: the first gathers, the last reductions, tp
    endless = exposed_comm(StepCompute(1e9, 1e9, 1e9), e.comms, e.mesh, train)
    assert endless == base
