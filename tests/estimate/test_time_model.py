"""The step-time model (estimate/compute.py and its parts) held to published measurements, and its parts' rules.

Analytic, no ranks: each test is milliseconds. The published rows are tests/fixtures/published_throughput.json;
docs/planning.md ("Validation against published measurements") has the same table with the predictions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndparallel.errors import ConfigError
from ndparallel.estimate import ClusterSpec, MeshShape, TrainingSpec, estimate, model_spec
from ndparallel.estimate.cli import main as plan_main
from ndparallel.estimate.comm import Collective
from ndparallel.estimate.compute import compute_time
from ndparallel.estimate.explain import breakdown
from ndparallel.estimate.hardware import GPU_KINDS
from ndparallel.estimate.kernels import gemm_efficiency
from ndparallel.estimate.memory_ops import block_forward_bytes, head_bytes
from ndparallel.estimate.units import GiB

ROWS = json.loads((Path(__file__).parents[1] / "fixtures" / "published_throughput.json").read_text())["rows"]


def _predict(row: dict) -> tuple[float, float]:
    """(tok/s per GPU, peak GiB as the row reads memory) for one published row, typed in as it was run."""
    train = TrainingSpec(
        global_batch=row["global_batch"], seq_len=row["seq"], micro_batch=row["micro_batch"],
        activation_checkpointing=row["ac"], selective_ac_option=row["ac_option"], compile=row["compile"],
        compiled_loss=row["compiled_loss"], fused_norm=row["fused_norm"],
    )  # fmt: skip
    cluster = ClusterSpec.from_gpu(row["gpu"], num_gpus=row["gpus"])
    e = estimate(model_spec(row["model"]), train, MeshShape(**row["mesh"]), cluster)
    peak = e.memory.peak / GiB
    if row["memory_kind"] == "reserved":  # what the planner asks of the allocator: peak / (1 - memory margin)
        peak /= 1 - cluster.memory_margin
    return e.time.tokens_per_s / row["gpus"], peak


PREDICTED = {row["id"]: _predict(row) for row in ROWS}


@pytest.mark.parametrize("row", ROWS, ids=[row["id"] for row in ROWS])
def test_published_rows(row):
    tok_s, memory = PREDICTED[row["id"]]
    error = tok_s / row["tok_s"] - 1
    assert row["tok_bound"] <= 0.15 or row.get("known_miss"), "a bound above 15 % needs its reason"
    message = f"{row['id']}: {tok_s:,.0f} tok/s predicted vs {row['tok_s']:,} ({error:+.1%})"
    assert abs(error) <= row["tok_bound"], message
    if row["memory_gib"] is not None:
        assert memory == pytest.approx(row["memory_gib"], rel=0.10)


def test_rows_of_one_table_keep_their_order():
    tables: dict[str, list[dict]] = {}
    for row in ROWS:
        tables.setdefault(row["table"], []).append(row)
    for rows in tables.values():
        measured = sorted(rows, key=lambda r: r["tok_s"])
        assert sorted(rows, key=lambda r: PREDICTED[r["id"]][0]) == measured


# ------------------------------------------------------------------------------------------ parts
def test_gemm_efficiency_grows_with_size():
    h100 = GPU_KINDS["h100"]
    sizes = [256, 1024, 4096, 16384]
    eff = [gemm_efficiency(n, n, n, h100.peak_flops, h100.hbm_bw) for n in sizes]
    assert eff == sorted(eff) and eff[0] < 0.2 and 0.78 < eff[-1] <= 0.80
    # a skinny GEMM (a few tokens) is bound by the weight's bytes, not by the FLOPs
    assert gemm_efficiency(8, 4096, 4096, h100.peak_flops, h100.hbm_bw) < 0.02


def test_attention_counts_the_causal_half_and_the_longer_backward():
    model, cluster = model_spec("1b"), ClusterSpec.from_gpu("h200", num_gpus=1)
    short, long = (
        compute_time(model, TrainingSpec(global_batch=1, seq_len=s), MeshShape(), cluster) for s in (2048, 4096)
    )
    assert long.attention_forward == pytest.approx(4 * short.attention_forward)  # s^2 per sequence
    assert long.attention_backward == pytest.approx(2.5 * long.attention_forward)
    flops = 2 * 4096**2 * model.q_dim * model.n_layers  # causal: half of 4 s^2 q per block
    assert long.attention_forward == pytest.approx(flops / (cluster.peak_flops * cluster.attention_eff))


def test_compile_moves_fewer_bytes():
    model, mesh = model_spec("8b"), MeshShape(dp_shard=8)
    eager, blocks = TrainingSpec(), TrainingSpec(compile="blocks")
    assert sum(block_forward_bytes(model, blocks, mesh, True, 2).values()) < 0.5 * sum(
        block_forward_bytes(model, eager, mesh, False, 2).values()
    )
    composite = TrainingSpec(fused_norm=False)
    assert (
        block_forward_bytes(model, composite, mesh, False, 2)["norm"]
        > block_forward_bytes(model, eager, mesh, False, 2)["norm"]
    )
    assert head_bytes(model, eager, mesh, True, 2) < head_bytes(model, eager, mesh, False, 2) / 5
    cluster = ClusterSpec.from_gpu("h100", num_gpus=8)
    steps = {c: estimate(model, TrainingSpec(global_batch=8, seq_len=8192, compile=c), mesh, cluster).time.step_s
             for c in ("none", "blocks")}  # fmt: skip
    assert steps["blocks"] < steps["none"]


def test_recompute_per_policy():
    model, mesh, cluster = model_spec("8b"), MeshShape(dp_shard=8), ClusterSpec.from_gpu("h100", num_gpus=8)
    policies = {"none": ("none", "2"), "op": ("selective", "op"), "layer2": ("selective", "2"), "full": ("full", "2")}
    recompute, memory = {}, {}
    for name, (mode, option) in policies.items():
        train = TrainingSpec(global_batch=8, seq_len=8192, activation_checkpointing=mode, selective_ac_option=option)
        e = estimate(model, train, mesh, cluster)
        recompute[name] = e.time.compute_by_kind.get("recompute", 0.0)
        memory[name] = e.memory.activations
    assert recompute["none"] == 0 < recompute["op"] < recompute["layer2"] < recompute["full"]
    assert memory["full"] < memory["op"] < memory["none"]
    with pytest.raises(ConfigError, match="selective_ac_option='x'"):
        TrainingSpec(activation_checkpointing="selective", selective_ac_option="x")


def test_link_latency_and_efficiency():
    def time(payload: float) -> float:
        return Collective("ag", "all_gather", "dp_shard", 8, "fsdp_forward", 1, payload, "intra", 450e9).time_s

    big, small = time(1e9), time(1e4)
    assert big == pytest.approx(1e9 * 7 / 8 / (450e9 * 0.8) + 10e-6)
    assert small < 2 * 10e-6  # a small message costs its latency
    assert (1e4 * 7 / 8 / small) < 0.05 * (1e9 * 7 / 8 / big)  # and reaches a sliver of the bandwidth


def test_pipeline_bubble_per_schedule_and_explain_sums():
    model, cluster = model_spec("8b"), ClusterSpec.from_gpu("h100", num_gpus=16)
    train = TrainingSpec(global_batch=16, seq_len=4096, activation_checkpointing="full")
    bubble = {}
    for schedule in ("1f1b", "interleaved_1f1b"):
        e = estimate(model, train, MeshShape(dp_shard=4, pp=4, pp_schedule=schedule), cluster)
        bubble[schedule] = e.time.bubble_s
        assert sum(seconds for _, _, seconds in breakdown(e)) == pytest.approx(e.time.step_s)
        assert {part for part, _, _ in breakdown(e)} >= {"compute", "bubble"}
    assert 0 < bubble["interleaved_1f1b"] < bubble["1f1b"]


def test_tp_exposed_fsdp_hidden():
    model, cluster = model_spec("8b"), ClusterSpec.from_gpu("h100", num_gpus=8)
    train = TrainingSpec(global_batch=8, seq_len=8192, activation_checkpointing="full")
    tp = estimate(model, train, MeshShape(tp=8), cluster).time
    fsdp = estimate(model, train, MeshShape(dp_shard=8), cluster).time
    assert tp.exposed_s["tp"] > 0.1 * tp.step_s
    assert fsdp.exposed_comm_s < 0.01 * fsdp.step_s < fsdp.comm_s


def test_mfu_is_an_override():
    model, mesh = model_spec("1b"), MeshShape(dp_shard=8)
    train = TrainingSpec(global_batch=8, seq_len=4096)
    flat = estimate(model, train, mesh, ClusterSpec(num_gpus=8, mfu=0.5)).time
    assert flat.compute_s == pytest.approx(8 * 4096 * model.flops_per_token(4096) / (8 * 989e12 * 0.5))
    assert estimate(model, train, mesh, ClusterSpec(num_gpus=8)).time.compute_s != pytest.approx(flat.compute_s)


def test_cli_flags_and_explain(capsys):
    argv = ["plan", "--model", "8b", "--gpus", "8", "--gpu", "h100-hbm2e", "--seq", "8192", "--global-batch", "16",
            "--micro-batch", "2", "--ac", "selective", "--selective-ac-option", "op", "--compile", "blocks",
            "--dp-shard", "8", "--no-pp", "--explain"]  # fmt: skip
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "selective per-op" in text and "compile blocks" in text and "step-time breakdown of 1x8x1x1" in text
    for kind in ("matmul", "attention", "memory-bound", "recompute", "optimizer"):
        assert f"compute       {kind}" in text
    assert plan_main([*argv[:-1], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["explain"] and data["ranked"][0]["time"]["compute_by_kind"]["recompute"] > 0
    # per-block compile under TP is refused by the runtime: the planner names the same refusal
    assert plan_main([*argv[:-4], "--tp", "2", "--dp-shard", "4", "--no-pp"]) == 1
    assert "compile='blocks' with tp_size=2 is not supported" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_main(["plan", "--model", "8b", "--gpus", "8", "--compile", "all"])
    assert "invalid choice: 'all'" in capsys.readouterr().err
    assert plan_main(["plan", "--model", "8b", "--gpus", "8", "--ac", "selective", "--selective-ac-option", "0"]) == 2
    assert "selective_ac_option='0' must be 'op'" in capsys.readouterr().err
