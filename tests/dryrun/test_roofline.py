"""The step time from the trace: each op the rank ran at a GPU's roofline, ``max(FLOPs / peak, bytes / HBM)``
(:mod:`ndparallel.dryrun.roofline`), and ``plan --dry-run`` printing it beside the planner's."""

from __future__ import annotations

import pytest
import torch

from ndparallel.dryrun.planner import compare, job_of, trace_compute, trace_compute_s
from ndparallel.dryrun.roofline import ATTENTION_OPS, op_seconds, split_s
from ndparallel.dryrun.run import dry_run
from ndparallel.dryrun.torch_api import fake_tensor_mode
from ndparallel.dryrun.tracker import RankTracker
from ndparallel.estimate import ClusterSpec, TrainingSpec, model_spec, plan
from ndparallel.estimate.hardware import GPU_KINDS
from ndparallel.estimate.overlap import exposed_comm
from ndparallel.launch.cli import main
from ndparallel.train.job_config import TrainConfig

H100 = GPU_KINDS["h100"]


def _census(run) -> list:
    mode = fake_tensor_mode()
    tracker = RankTracker(mode)
    with mode, tracker.active():
        run()
    return tracker.ops.rows()


def test_a_matmul_takes_its_flops_at_peak_and_an_add_its_bytes_at_bandwidth():
    n = 4096

    def run() -> None:
        a = torch.empty(n, n, dtype=torch.bfloat16)
        torch.mm(a, a)
        torch.add(a, a)

    rows = {row.op: row for row in _census(run)}
    assert set(rows) == {"aten.mm", "aten.add"}  # the allocation moves nothing
    mm, add = rows["aten.mm"], rows["aten.add"]
    assert (mm.flops, mm.bytes, mm.calls, mm.part) == (2 * n**3, 3 * n * n * 2, 1, "step")
    assert op_seconds(mm.flops, mm.bytes, H100.peak_flops, H100.hbm_bw) == mm.flops / H100.peak_flops
    assert (add.flops, add.bytes) == (0, 3 * n * n * 2)
    assert op_seconds(add.flops, add.bytes, H100.peak_flops, H100.hbm_bw) == add.bytes / H100.hbm_bw


def test_the_trace_step_time_is_the_sum_of_its_ops_at_the_roofline():
    cfg = TrainConfig.from_sources(
        None,
        ["model.preset=tiny", "data.seq_len=32", "model.max_seq_len=32", "tp_size=2", "dp_shard_size=-1",
         "mixed_precision=bf16"],
        {},
        host_checks=False,
    )  # fmt: skip
    (rank,) = dry_run(cfg, 4).ranks
    total = rank.roofline_s(H100.peak_flops, H100.hbm_bw)
    assert total > 0
    by_op = sum(o.calls * op_seconds(o.flops, o.bytes, H100.peak_flops, H100.hbm_bw) for o in rank.ops)
    assert total == pytest.approx(by_op, rel=1e-12)
    parts = [rank.roofline_s(H100.peak_flops, H100.hbm_bw, part) for part in ("step", "optimizer")]
    assert min(parts) > 0 and sum(parts) == pytest.approx(total, rel=1e-12)
    # the same FLOPs as the report's (FlopCounterMode's formulas; the CPU flash attention, which torch's registry
    # lacks, counted as the GPU's flash kernel in both)
    flash = [o for o in rank.ops if "flash_attention" in o.op]
    assert flash and all(o.flops > 0 for o in flash)
    assert sum(o.calls * o.flops for o in rank.ops) == rank.flops


def test_plan_dry_run_prints_the_analytic_and_the_trace_step_time(capsys):
    args = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "4", "--dp-shard", "2"]
    assert main([*args, "--top", "1", "--dry-run", "--dry-run-top", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("mesh "))
    assert "compute s" in lines[head] and "step s" in lines[head]
    columns = lines[head + 1].split()
    plan_s, trace_s = (float(x) for x in columns[columns.index("0") + 8].split("|"))
    assert plan_s > 0 and trace_s > 0


def test_the_census_splits_forward_backward_with_recompute_and_attention_as_the_planner_does():
    cfg = TrainConfig.from_sources(
        None,
        ["model.preset=tiny", "data.seq_len=32", "model.max_seq_len=32", "dp_shard_size=-1", "train.global_batch=4",
         "train.micro_batch=1", "activation_checkpointing=full", "mixed_precision=bf16"],
        {},
        host_checks=False,
    )  # fmt: skip
    (rank,) = dry_run(cfg, 2).ranks
    phases = {(o.part, o.phase) for o in rank.ops}
    assert phases == {("step", "forward"), ("step", "backward"), ("step", ""), ("optimizer", "")}
    # a checkpointed block's forward runs again in backward: recompute is backward's, as in the planner
    flash = {(o.op, o.phase): o.calls for o in rank.ops if o.op in ATTENTION_OPS}
    fwd, bwd = (
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    )
    assert flash == {(fwd, "forward"): 4, (fwd, "backward"): 4, (bwd, "backward"): 4}  # 2 micro-batches x 2 blocks
    assert {o.op for o in rank.ops if o.part == "step" and not o.phase} >= {"aten._foreach_norm"}  # clipping
    split = split_s(rank.ops, H100.peak_flops, H100.hbm_bw)
    total = rank.roofline_s(H100.peak_flops, H100.hbm_bw)
    assert split.forward_s + split.backward_s + split.per_step_s == pytest.approx(total, rel=1e-12)
    assert split.backward_s > split.forward_s > split.attention_s > 0
    attention = sum(o.calls * op_seconds(o.flops, o.bytes, H100.peak_flops, H100.hbm_bw) for o in rank.ops
                    if o.op in ATTENTION_OPS)  # fmt: skip
    assert split.attention_s == pytest.approx(attention, rel=1e-12)
    assert split.per_step_s > rank.roofline_s(H100.peak_flops, H100.hbm_bw, "optimizer")


def test_the_trace_step_time_applies_the_overlap_rules_to_the_trace_compute():
    model, train = model_spec("tiny"), TrainingSpec(seq_len=64, global_batch=4)
    e = plan(model, train, ClusterSpec(num_gpus=2), fixed={"dp_shard": 2}).ranked[0]
    report = dry_run(job_of(model, train, e.mesh), e.mesh.world_size)
    (rank,) = report.ranks
    # the roofline of a GPU with 1/1000 of the bandwidth: the trace's compute far above the planner's, so it hides
    # more of the planner's communication than the planner's own compute did
    slow = ClusterSpec(num_gpus=2, hbm_bw=ClusterSpec().hbm_bw / 1000)
    for cluster in (None, slow):
        (side,) = compare(e, model, train, report, cluster)
        hbm_bw = (cluster or ClusterSpec()).hbm_bw
        compute = trace_compute(e, rank, hbm_bw)
        exposed = sum(exposed_comm(compute, e.comms, e.mesh, train).values())
        assert side.compute_s == (e.time.compute_s, trace_compute_s(e, rank, hbm_bw))
        assert side.step_s == (e.time.step_s, side.compute_s[1] + exposed)
    assert side.compute_s[1] > e.time.compute_s
    assert side.step_s[1] - side.compute_s[1] < e.time.exposed_comm_s
