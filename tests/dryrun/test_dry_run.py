"""``ndparallel dry-run``: the real job's refusals at its real width, what a rank reports, the command's output.

One process each, on torch's fake process group: no ranks are spawned. The agreement with real gloo ranks is
``test_real_ranks_agree.py``.
"""

from __future__ import annotations

import json

import pytest

from ndparallel.dryrun.cli import main
from ndparallel.dryrun.run import dry_run
from ndparallel.errors import ConfigError
from ndparallel.train.job_config import TrainConfig

TINY = ["model.preset=tiny", "data.seq_len=32", "model.max_seq_len=32"]


def _config(*overrides: str) -> TrainConfig:
    return TrainConfig.from_sources(None, [*TINY, *overrides], {}, host_checks=False)


# (overrides, world, what the one-line refusal says): each the real job's own ConfigError
REFUSED = {
    "tp 16 on 8 kv heads": (["model.preset=8b", "tp_size=16", "dp_shard_size=-1"], 1024, "tp_size=16 does not divide"),
    "ep 8 on 4 experts at 1,024": (
        ["model.preset=tiny-moe", "ep_size=8", "dp_shard_size=-1", "train.global_batch=1024"],
        1024,
        "ep_size=8 does not divide model.n_experts=4",
    ),
    "an empty pipeline stage": (["pp_size=4", "pp_schedule=interleaved_1f1b", "dp_shard_size=-1"], 16, "every stage"),
    "micro-batches that do not divide": (
        ["dp_shard_size=-1", "train.global_batch=16", "train.micro_batch=3"],
        8,
        "train.micro_batch=3 does not divide",
    ),
    "a world the mesh does not divide": (["tp_size=4", "dp_shard_size=-1"], 10, "cannot fill world size 10"),
    "a world over 16,384": ([], 20_000, "1 to 16,384 ranks"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_real_jobs_refusal_before_any_rank_is_built(case):
    overrides, world, words = REFUSED[case]
    cfg = _config(*overrides)
    with pytest.raises(ConfigError, match=words) as refused:
        dry_run(cfg, world)
    assert "\n" not in str(refused.value)
    if world <= 16_384 and "fill" not in words:  # the same message as the real job's pre-flight
        with pytest.raises(ConfigError) as real:
            cfg.check_mesh(cfg.parallelism.resolve(world))
        assert str(real.value) == str(refused.value)


def test_a_model_too_large_for_fake_metadata_is_one_line():
    cfg = _config("model.dim=4611686018427387904", "model.n_heads=2", "model.n_kv_heads=2", "dp_shard_size=-1")
    with pytest.raises(ConfigError, match="too large even for fake tensors' metadata") as refused:
        dry_run(cfg, 8)
    assert "\n" not in str(refused.value)


def reads_its_weights():
    """A factory whose construction reads tensor values (as one loading a checkpoint does)."""
    import torch

    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    if float(model[0][0].weight.detach().sum()) > 1e9:  # a value: fake tensors have none
        raise AssertionError
    return model


def test_a_module_that_reads_values_at_construction_is_one_line():
    with pytest.raises(ConfigError, match="cannot be built on fake tensors") as refused:
        dry_run(_config("dp_shard_size=-1"), 2, model=f"{__name__}:reads_its_weights")
    assert "\n" not in str(refused.value)


def test_ranks_that_differ_each_pp_stage_and_the_smallest_shards():
    """pp 2 x FSDP 8 with a vocabulary of 260 rows (8 does not divide it): the first rank of each stage, and the
    last shard rank of each; state bytes follow the shards, the collectives each stage's parameters."""
    cfg = _config("pp_size=2", "dp_shard_size=-1", "model.vocab_size=260", "train.global_batch=16")
    report = dry_run(cfg, 16, gpu_memory=2**40)
    assert [r.rank for r in report.ranks] == [0, 7, 8, 15]
    assert [r.stage_ids for r in report.ranks] == [[0], [0], [1], [1]]
    first, last = report.ranks[0], report.ranks[1]
    assert first.peak_by_kind["params"] > last.peak_by_kind["params"]  # the smallest shards are the last rank's
    for r in report.ranks:
        assert r.peak_by_kind["optimizer"] >= 2 * r.peak_by_kind["params"]  # AdamW: exp_avg, exp_avg_sq, step
        dims = {c.dim for c in r.comms}
        assert {"dp_shard", "pp"} <= dims
        assert r.flops > 0 and r.activation_peak_bytes > 0 and r.peak_module and "step 1" in r.peak_phase
    assert report.out_of_memory() is None


def test_a_mixture_of_experts_under_pp_and_ep():
    """tiny-moe on pp 2 x FSDP 4 x ep 2: the stages exchange their routers' loads after the step (a tensor
    all-gather whose layout the dry run keeps real; DeepSeek-V3's cell at 1,024 ranks once failed there)."""
    cfg = _config("model.preset=tiny-moe", "pp_size=2", "dp_shard_size=-1", "ep_size=2", "train.global_batch=8")
    report = dry_run(cfg, 8, gpu_memory=2**40)
    assert [r.stage_ids for r in report.ranks] == [[0], [1]]
    for r in report.ranks:
        assert {"pp", "ep"} <= {c.dim for c in r.comms} and r.flops > 0


def test_out_of_memory_names_rank_phase_and_module(capsys):
    code = main(["dry-run", "--world", "8", *TINY, "dp_shard_size=-1", "--gpu-mem", "0.001GiB"])
    out = capsys.readouterr().out
    assert code == 1
    line = next(line for line in out.splitlines() if line.startswith("OUT OF MEMORY"))
    assert "rank 0" in line and "step 1: forward/backward, micro-batch 1" in line and "module " in line


def test_json_report(capsys):
    assert main(["dry-run", "--world", "4", *TINY, "tp_size=2", "dp_shard_size=-1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world"] == 4 and data["limits"] and data["out_of_memory"] is None
    (rank,) = data["ranks"]
    assert set(rank["peak_by_kind"]) == {
        "params",
        "unsharded_params",
        "grads",
        "optimizer",
        "activations",
        "temporaries",
    }
    assert {c["dim"] for c in rank["comms"]} >= {"tp", "dp_shard"}


def test_plan_dry_run_of_another_family_points_at_dry_run_model(tmp_path, capsys):
    """``plan --dry-run`` builds the reference Transformer of the planned sizes: a Hugging Face config is refused
    with the command that dry-runs it."""
    config = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["plan", "--model", str(tmp_path / "config.json"), "--gpus", "2", "--seq", "32", "--global-batch", "4"]
    from ndparallel.launch.cli import main as ndparallel_main  # the command that has plan (this file's main: dry-run)

    assert ndparallel_main([*args, "--dp-shard", "2", "--top", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "plan --dry-run builds the reference Transformer" in err and "ndparallel dry-run --model" in err, err
