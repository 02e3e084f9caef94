"""The step time from the trace: each op the rank ran at a GPU's roofline, ``max(FLOPs / peak, bytes / HBM)``
(:mod:`ndparallel.dryrun.roofline`), and ``plan --dry-run`` printing it beside the planner's."""

from __future__ import annotations

import pytest
import torch

from ndparallel.dryrun.roofline import op_seconds
from ndparallel.dryrun.run import dry_run
from ndparallel.dryrun.torch_api import fake_tensor_mode
from ndparallel.dryrun.tracker import RankTracker
from ndparallel.estimate.hardware import GPU_KINDS
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
