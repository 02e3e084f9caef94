"""The scaling harness: real gloo ranks give sane numbers, exact communication counts, one JSON schema.

The multi-rank check runs the ``bench`` command itself (two cases: one rank, FSDP over two ranks) and
reads everything back from its JSON, so CLI, harness, counter, memory tracker and report are covered
by one spawned job per world size. The sweep config's refusals are one parametrised test over the layouts
(dense and pipeline); one pp case and one ep case are measured on real ranks.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ndparallel.bench.cli import apply_defaults_overrides
from ndparallel.bench.memory import LiveMemory, state_bytes
from ndparallel.bench.report import SCHEMA
from ndparallel.bench.sweep import cases_from_config, load_cases
from ndparallel.errors import ConfigError
from ndparallel.launch.cli import main
from ndparallel.models import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]

BENCH_YAML = {
    "defaults": {"model": {"preset": "tiny"}, "seq_len": 32, "warmup": 1, "steps": 3},
    "sweeps": [{"name": "strong", "global_batch": 4, "shapes": [{"label": "single"}, {"dp_shard_size": 2}]}],
}


def _block_params(cfg: TransformerConfig) -> int:
    kv = cfg.n_kv_heads * cfg.head_dim
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim


def _pipe_config(*shapes: dict, **defaults) -> dict:
    """A pipeline sweep of ``shapes`` (global batch 8); ``defaults`` go beside the model, seq_len and steps."""
    return {
        "defaults": {"model": {"preset": "tiny"}, "seq_len": 16, "warmup": 0, "steps": 1, **defaults},
        "sweeps": [{"name": "pipe", "global_batch": 8, "shapes": list(shapes)}],
    }


def test_bench_command_two_ranks(tmp_path, capsys):
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump(BENCH_YAML))
    out = tmp_path / "out"
    assert main(["bench", "--config", str(config), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "strong/dp_shard2" in printed and "tok/s" in printed and "reduce_scatter" in printed

    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == SCHEMA
    assert doc["machine"]["torch"] == torch.__version__ and doc["machine"]["peak_flops"] > 0
    single, fsdp = doc["results"]
    assert [single["world_size"], fsdp["world_size"]] == [1, 2]
    for r in (single, fsdp):
        assert len(r["step_s"]) == 3 and all(0 < t < 60 for t in r["step_s"])
        assert r["step_min_s"] <= r["step_median_s"] <= r["step_max_s"]
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_median_s"])
        assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / r["world_size"])
        assert 0 < r["mfu"] < 1
        assert r["twin_step_median_s"] > 0 and r["exposed_comm_s"] is not None
        # Peak live bytes cover at least parameters + gradients + AdamW's two moments.
        assert r["peak_memory_bytes"] >= 2 * r["param_bytes"] + r["optimizer_bytes"]
        assert r["optimizer_bytes"] >= 2 * r["param_bytes"]

    # Same model, same global batch: FSDP over 2 ranks reproduces the single-rank losses (fp32).
    assert fsdp["losses"] == pytest.approx(single["losses"], abs=1e-5)

    # Parameters: each FSDP rank holds exactly half (every tiny dim is even, so no padding).
    cfg = TransformerConfig.from_preset("tiny")
    total = cfg.num_params() * 4
    assert single["param_bytes"] == total and fsdp["param_bytes"] == total // 2
    assert single["comm"] == [] and single["exposed_comm_s"] == 0.0

    # Communication of one FSDP step, payload bytes (an all-gather's output, a reduce-scatter's input):
    # forward gathers every unit (embedding, 2 blocks, [norm + output]) = all parameters; backward
    # gathers them again except the last block, which ndparallel keeps unsharded after forward; one
    # reduce-scatter per unit moves every gradient. Per rank the ring sends (n-1)/n of each payload,
    # i.e. for n = 2 the all-gathers send 2 x shard bytes x (n-1) minus the last block's shard.
    comm = {row["kind"]: row for row in fsdp["comm"]}
    assert {row["dims"] for row in fsdp["comm"]} == {"dp_shard"}, fsdp["comm"]
    units = cfg.n_layers + 2
    last_block = _block_params(cfg) * 4
    assert comm["all_gather"]["calls"] == 2 * units - 1
    assert comm["all_gather"]["bytes"] == total + (total - last_block)
    assert comm["reduce_scatter"]["calls"] == units
    assert comm["reduce_scatter"]["bytes"] == total
    # The global gradient norm, clipping's same-gradients check, and the step's non-finite agreement.
    assert comm["all_reduce"]["calls"] == 3
    assert fsdp["comm_bytes"] == sum(row["bytes"] for row in fsdp["comm"])

    # A saved run re-renders without running anything.
    assert main(["bench", "--from-json", str(out / "results.json"), "--no-plot"]) == 0
    assert "strong/dp_shard2" in capsys.readouterr().out

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "scaling.png").exists()
    else:
        assert (out / "scaling.png").stat().st_size > 0 and (out / "memory.png").stat().st_size > 0


def test_live_memory_counts_storages_once_and_sees_frees_and_resizes():
    keep = torch.zeros(256)  # 1 KiB alive before and during: a root
    with LiveMemory([keep]) as memory:
        a = torch.zeros(1024)  # 4 KiB
        view = a[10:]  # same storage: counted once
        b = view * 2  # 4 KiB - 40 bytes
        del a, view, b
        c = torch.zeros(512)  # 2 KiB, after 8 KiB were freed
        c.untyped_storage().resize_(0)  # FSDP-style free: counts 0 from now on
        d = torch.ones(16)
        del d
    assert memory.start_bytes == 1024
    assert memory.peak_bytes == 1024 + 4096 + 4096 - 40
    assert memory.live_bytes() == 1024
    assert state_bytes([keep, keep[1:], c]) == 1024


def test_sweep_config_strong_and_weak_batches():
    data = {
        "defaults": {"model": "tiny", "seq_len": 32},
        "sweeps": [
            {
                "name": "strong",
                "global_batch": 8,
                "shapes": [{}, {"dp_shard_size": 4}, {"dp_shard_size": 2, "tp_size": 2}],
            },
            {"name": "weak", "batch_per_dp_rank": 2, "models": ["tiny", "small"], "shapes": [{"dp_replicate_size": 2}]},
        ],
    }
    cases = cases_from_config(data)
    names = ["strong/single", "strong/dp_shard4", "strong/dp_shard2_tp2", "weak/tiny/dp_replicate2"]
    assert [c.name for c in cases] == [*names, "weak/small/dp_replicate2"]
    assert [c.global_batch for c in cases] == [8, 8, 8, 4, 4]
    assert [c.world_size for c in cases] == [1, 4, 4, 2, 2]
    assert cases[4].model == {"preset": "small"}
    data = apply_defaults_overrides(data, ["steps=2", "model.n_layers=1"])
    assert {c.steps for c in cases_from_config(data)} == {2}
    assert cases_from_config(data)[0].model == {"preset": "tiny", "n_layers": 1}


def _dense(**sweep) -> dict:
    """A one-sweep config on the tiny model (the dense layouts)."""
    return {"defaults": {"model": "tiny"}, "sweeps": [{"name": "s", **sweep}]}


@pytest.mark.parametrize(
    "config, message",
    [
        (_dense(global_batch=6, shapes=[{"dp_shard_size": 4}]), "global_batch=6 is not divisible"),
        (_dense(global_batch=4, batch_per_dp_rank=1, shapes=[{}]), "exactly one of global_batch"),
        (_dense(global_batch=4, shapes=[{"tp_size": 3}]), "tp_size=3"),
        (_dense(global_batch=4, shapes=[{"dp_shard_size": -1}]), "no -1"),
        (_dense(global_batch=4, shapes=[{"cp_size": 2}], seq_len=30), "not divisible by 2 x cp_size"),
        (_dense(global_batch=4, shapes=[{}], seq_len=4096), "max_seq_len"),
        (_dense(global_batch=4, shapes=[{}], stepz=3), "unknown key"),
        # pipeline cases the trainer would refuse are refused early
        (_pipe_config({"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 3}),
         re.escape("pp_microbatches=3 does not divide the per-rank batch 8")),
        (_pipe_config({"pp_size": 4, "pp_schedule": "1f1b", "pp_microbatches": 2}),
         re.escape("pp_microbatches=2 is fewer than the 4")),
        (_pipe_config({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 4, "pp_microbatches": 4}),
         re.escape("pp_size=2 x pp_stages_per_rank=4 = 8 pipeline stages but model.n_layers=2")),
        (_pipe_config({"pp_size": 2, "pp_schedule": "1f1b", "micro_batch": 8}),
         re.escape("(set pp_microbatches, or a smaller train.micro_batch)")),
        # torch's stage always defers the gradient sync under FSDP: false is not honoured
        (_pipe_config({"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 2},
                      defer_grad_sync=False),
         re.escape("defer_grad_sync=false cannot be honoured with pp_size=2")),
    ],
    ids=["dense-batch", "dense-batch-fields", "dense-tp", "dense-minus-one", "dense-cp-seq", "dense-max-seq",
         "dense-unknown-key", "pp-microbatches", "pp-fewer-microbatches", "pp-stages", "pp-micro-batch",
         "pp-defer-grad-sync"],
)  # fmt: skip
def test_sweep_config_errors_name_the_field(config, message):
    with pytest.raises(ConfigError, match=message):
        cases_from_config(config)


def test_default_config_parses_and_gpu_script_dry_run(tmp_path, monkeypatch):
    cases = cases_from_config(yaml.safe_load((ROOT / "benchmarks" / "scaling.yaml").read_text()))
    assert {c.sweep for c in cases} == {"strong", "weak", "pipeline"}
    assert max(c.world_size for c in cases) == 8 and all(c.device == "cpu" for c in cases)

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu  # benchmarks/gpu.py

    out = tmp_path / "gpu.json"
    assert gpu.main(["--dry-run", "--steps", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["variant"] for r in doc["results"]] == ["torch-eager", "torch-compiled", "ndp-compile", "ndp-fsdp1"]
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"]) for r in doc["results"])
    assert doc["correctness"]["fsdp"]["ok"] and doc["correctness"]["fsdp_tp"]["ok"]
    sys.modules.pop("gpu", None)


def test_scaling_yaml_compares_schedules_side_by_side():
    cases = load_cases(ROOT / "benchmarks" / "scaling.yaml", only=["pipeline"])
    labels = [c.label for c in cases]
    assert labels[:4] == ["single", "pp2_gpipe_m4", "pp2_1f1b_m4", "pp2_interleaved_1f1b_m4"]
    assert [c.world_size for c in cases] == [1, 2, 2, 2, 4, 4]  # pp ranks count in the world size
    gpipe = cases[1]
    assert gpipe.pipeline_shape().pp == 2 and gpipe.pipeline_shape().pp_schedule == "gpipe"


def test_a_pp_case_is_measured_on_real_ranks_and_trains_like_one_rank():
    """The bench runs a pp case through ndparallel.parallel.pipeline and TrainStep: same losses as one rank (fp32, same
    seed and global batch), and the table shows the schedule."""
    from ndparallel.bench.harness import run_cases
    from ndparallel.bench.report import format_table

    config = _pipe_config({"label": "single"}, {"pp_size": 2, "pp_schedule": "gpipe", "pp_microbatches": 4})
    config["defaults"].update(steps=2, compute_twin=False)
    single, pipe = run_cases(cases_from_config(config), peak_flops=1e12, verbose=False)
    assert not pipe.error and len(pipe.losses) == 2, pipe.error
    assert pipe.losses == pytest.approx(single.losses, abs=1e-5)  # fp32; float64: pipeline/test_parity.py
    assert pipe.pipeline["schedule"] == "gpipe" and pipe.pipeline["microbatches"] == 4
    assert "pp2 gpipe m4" in format_table([single, pipe])


def test_an_moe_case_reports_router_health_and_its_all_to_all_bytes():
    """ep 2 on 2 ranks (the ep group is the whole dp_shard group): rank 0's all-to-all payload is exactly what
    its routing needs. Per MoE block it sends its own routed rows out and their gradients back (``rows``), the
    outputs and input gradients of the rows its experts received (the global tokens of experts 0..E/2-1),
    and the counts (an int64 per expert)."""
    from ndparallel.bench import BenchCase, run_cases
    from ndparallel.bench.report import format_experts_table

    model = {"preset": "tiny-moe"}
    case = BenchCase("moe", "ep2", model, {"dp_shard_size": 2, "ep_size": 2, "mixed_precision": "no"},
                     seq_len=16, global_batch=4, warmup=1, steps=1, compute_twin=False)  # fmt: skip
    [result] = run_cases([case], peak_flops=1e12, verbose=False)
    cfg = TransformerConfig.from_dict(model)
    experts = result.experts
    assert experts["dropped"] == 0 and len(experts["tokens_per_expert"]) == cfg.n_layers
    rows = 2 * 16 * cfg.top_k  # this rank's sequences x tokens x top_k
    element = 4  # fp32
    received = [sum(load[: cfg.n_experts // 2]) for load in experts["tokens_per_expert"]]
    expected = sum((2 * rows + 2 * got) * cfg.dim * element + cfg.n_experts * 8 for got in received)
    sent = sum(row["bytes"] for row in result.comm if row["kind"] == "all_to_all")
    assert sent == expected
    assert {row["dims"] for row in result.comm if row["kind"] == "all_to_all"} == {"dp_shard = ep"}
    assert experts["all_to_all_min_bytes"] == 4 * cfg.n_layers * rows * cfg.dim * element
    peak = max(max(load) / (sum(load) / len(load)) for load in experts["tokens_per_expert"])
    assert experts["imbalance"] == pytest.approx(peak)
    assert "moe/ep2" in format_experts_table([result])
