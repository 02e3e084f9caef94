"""Pipeline-parallel config fields, their sources (YAML / env / CLI / Accelerate names), validation and the
pp groups of the mesh table: no ranks started."""

from __future__ import annotations

import pytest
import torch

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.pipeline import torch_compiles_pipeline_stages, torch_supports_v_schedules
from ndparallel.distributed.mesh import rank_groups
from ndparallel.errors import ConfigError
from ndparallel.launch.cli import main


def test_pp_size_from_every_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallelism:\n  pp_size: 2\n  pp_schedule: gpipe\n  pp_split: [[0, 1], [1, 4]]\n")
    cfg = ParallelismConfig.from_yaml(path)
    assert (cfg.pp_size, cfg.pp_schedule, cfg.pp_split) == (2, "gpipe", [[0, 1], [1, 4]])
    assert ParallelismConfig.from_env({"NDP_PP_SIZE": "4"}).pp_size == 4
    assert ParallelismConfig.from_env({"PARALLELISM_CONFIG_PP_SIZE": "2"}).pp_size == 2  # accelerate-style name
    assert ParallelismConfig.from_dict({"parallelism_config_pp_size": 2}).pp_size == 2
    cli = ParallelismConfig().with_overrides(["pp_size=2", "pp_microbatches=4", "pp_split=[[0,2],[2,4]]"])
    assert (cli.pp_size, cli.pp_microbatches, cli.pp_split) == (2, 4, [[0, 2], [2, 4]])
    env_over_file = ParallelismConfig.from_sources({"pp_size": 2}, {"NDP_PP_SIZE": "4"}, ["tp_size=1"])
    assert env_over_file.pp_size == 4


def test_pp_resolves_like_the_other_sizes():
    cfg = ParallelismConfig(pp_size=-1, tp_size=2).resolve(8)
    assert cfg.sizes == {"pp": 4, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert cfg.describe() == "pp=4 x tp=2"
    assert ParallelismConfig(pp_size=2, dp_shard_size=-1).resolve(8).dp_shard_size == 4
    with pytest.raises(ConfigError, match="mesh sizes multiply to 6"):
        ParallelismConfig(pp_size=3, tp_size=2).resolve(8)
    with pytest.raises(ConfigError, match="pp_size=-1 cannot fill world size 6"):
        ParallelismConfig(pp_size=-1, tp_size=4).resolve(6)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"pp_schedule": "zerobubble"}, "pp_schedule='zerobubble' is not one of"),
        ({"pp_microbatches": 0}, "pp_microbatches=0 must be a positive integer"),
        ({"pp_microbatches": 1}, "pp_microbatches=1 is fewer than the 2 pipeline stages"),
        ({"pp_schedule": "dualpipev", "pp_microbatches": 3}, "pp_microbatches=3 is fewer than the 4"),
        ({"pp_schedule": "interleaved_1f1b", "pp_microbatches": 5}, "micro-batches // pp_size) == 0"),
        ({"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 1}, "needs at least 2 stages per rank"),
        ({"pp_schedule": "1f1b", "pp_stages_per_rank": 2}, "runs one stage per rank"),
        ({"pp_schedule": "zbv", "pp_stages_per_rank": 3}, "V schedules place exactly 2"),
        ({"pp_split": [[0, 2], [3, 4]]}, "contiguous and start at block 0"),
        ({"pp_split": [[0, 4]]}, "pp_split has 1 ranges but there are 2 stages"),
        ({"pp_split": "0-2"}, "must be a list of [first, last) block ranges"),
        ({"mixed_precision": "bf16", "dp_shard_size": 2, "pp_schedule": "zbv"}, "mixed_precision='bf16' under FSDP"),
        ({"mixed_precision": "fp16", "cp_size": 2, "pp_schedule": "interleaved_zb"}, "pp_schedule='interleaved_zb'"),
    ],
)
def test_pp_validation_names_the_field(fields, fragment, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0")  # the V-schedule rules, whatever torch is installed
    with pytest.raises(ConfigError) as info:
        ParallelismConfig(pp_size=2, **fields)
    assert fragment in str(info.value)


def test_pp_rules_only_apply_with_pp(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0")  # the version-gated rules are tested on their own below
    ParallelismConfig(activation_checkpointing="full", pp_microbatches=1)  # pp_size 1: nothing to refuse
    ParallelismConfig(pp_size=2, pp_microbatches=2)
    ParallelismConfig(pp_size=2, mixed_precision="bf16", dp_shard_size=2, cpu_offload=True)  # lifted: a parity test
    ParallelismConfig(pp_size=2, mixed_precision="bf16", pp_schedule="zbv")  # no FSDP: autocast, no bf16 sum
    ParallelismConfig(
        pp_size=2, pp_schedule="interleaved_1f1b", pp_microbatches=4, pp_split=[[0, 1], [1, 2], [2, 3], [3, 4]]
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"activation_checkpointing": "full"},
        {"activation_checkpointing": "selective"},
        {"compile": "model"},
        {"compile": "blocks"},
        {"cp_size": 2, "cp_rotate_method": "alltoall"},
        {"cp_size": 2, "cp_rotate_method": "allgather"},
        {"dp_replicate_size": 2, "dp_shard_size": 2},
        {"dp_replicate_size": 2, "cp_size": 2},
    ],
)
def test_pp_composes_with_what_a_parity_test_covers(fields, monkeypatch):
    # tests/parallel/pipeline/test_compose.py proves each exact in float64 (compile on torch >= 2.12: tested below)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    assert ParallelismConfig(pp_size=2, **fields).pp_size == 2


def test_v_schedules_need_torch_2_12(monkeypatch):
    assert not torch_supports_v_schedules("2.11.0+cu130")
    assert torch_supports_v_schedules("2.12.0") and torch_supports_v_schedules("2.14.1+cpu")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ConfigError, match="pp_schedule='zbv' needs torch >= 2.12"):
        ParallelismConfig(pp_size=2, pp_schedule="zbv")
    ParallelismConfig(pp_size=2, pp_schedule="interleaved_zb")  # loop placement: fine on 2.11


def test_compile_under_pp_needs_torch_2_12(monkeypatch):
    assert not torch_compiles_pipeline_stages("2.11.0+cu130") and torch_compiles_pipeline_stages("2.13.0+cpu")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ConfigError, match="compile='blocks' with pp_size=2 needs torch >= 2.12"):
        ParallelismConfig(pp_size=2, compile="blocks")
    ParallelismConfig(pp_size=1, compile="blocks")  # without pp: fine on 2.11


def test_pp_groups_in_rank_table(tmp_path, capsys):
    cfg = ParallelismConfig(pp_size=2, dp_shard_size=2, tp_size=2).resolve(8)
    groups = rank_groups(cfg)
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dp_shard_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # views stay inside one pp slice
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    path = tmp_path / "m.yaml"
    path.write_text("parallelism:\n  pp_size: 2\n  dp_shard_size: 2\n  tp_size: 2\n")
    assert main(["mesh", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pp=2 x dp_shard=2 x tp=2" in out and "groups: [0,4] [1,5] [2,6] [3,7]" in out


def _train_config(parallel: dict, **train):
    from ndparallel.train.job_config import TrainConfig

    return TrainConfig.from_dict({"parallelism": parallel, "model": {"n_layers": 4}, "train": train})


@pytest.mark.parametrize(
    "parallel, train, fragment",
    [
        (
            {"pp_size": 4, "pp_schedule": "interleaved_1f1b"},
            {"micro_batch": 2},
            "= 8 pipeline stages but model.n_layers=4",
        ),
        (
            {"pp_size": 2},
            {"global_batch": 8, "micro_batch": 8},
            "pp_microbatches unset: train.global_batch / dp / train.micro_batch",
        ),
        ({"pp_size": 2, "pp_microbatches": 4}, {"global_batch": 8, "micro_batch": 4}, "disagree"),
        ({"pp_size": 2, "pp_microbatches": 3}, {"global_batch": 8}, "does not divide the per-rank batch 8"),
        ({"pp_size": 2, "pp_split": [[0, 1], [1, 3]]}, {"micro_batch": 2}, "but the model has 4 blocks"),
    ],
)
def test_train_config_checks_pp_before_ranks_start(parallel, train, fragment):
    cfg = _train_config(parallel, **train)
    with pytest.raises(ConfigError) as info:
        cfg.check_mesh(cfg.parallelism.resolve(cfg.parallelism.world_size))
    assert fragment in str(info.value)


def test_train_config_pp_accumulation_is_the_micro_batching():
    cfg = _train_config({"pp_size": 2, "pp_microbatches": 4}, global_batch=8)
    assert cfg.check_mesh(cfg.parallelism.resolve(cfg.parallelism.world_size)) == 4
    cfg = _train_config({"pp_size": 2}, global_batch=8, micro_batch=2)
    assert cfg.check_mesh(cfg.parallelism.resolve(cfg.parallelism.world_size)) == 4


def test_accelerator_refuses_pp_with_gradient_accumulation_by_name():
    from ndparallel import Accelerator

    # pp itself runs (tests/accelerator/test_pipeline.py); accumulation is the pipeline's micro-batching
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=4 with pp_size=2.*pp_microbatches"):
        Accelerator(ParallelismConfig(pp_size=2), gradient_accumulation_steps=4)
