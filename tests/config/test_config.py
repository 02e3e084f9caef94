"""ParallelismConfig: construction, round trips, overrides, and a clear error for every bad input."""

from __future__ import annotations

import pytest

from ndparallel import ConfigError, ParallelismConfig
from ndparallel.train.job_config import TrainConfig


def test_defaults_and_resolve_fill():
    cfg = ParallelismConfig(dp_shard_size=-1, tp_size=2)
    resolved = cfg.resolve(8)
    assert resolved.sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}
    assert resolved.world_size == 8
    assert cfg.dp_shard_size == -1, "resolve returns a copy"
    assert ParallelismConfig().resolve(1).describe() == "single rank (all sizes 1)"
    assert resolved.describe() == "dp_shard=4 x tp=2"


def _bad_yaml(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return lambda: ParallelismConfig.from_yaml(path)


BAD_CONFIGS = [
    # (description, callable raising, fragment the message must contain)
    (
        "product != world",
        lambda tmp: ParallelismConfig(dp_shard_size=2, tp_size=2).resolve(8),
        "multiply to 4 (dp_shard_size=2 x tp_size=2) but the world size is 8",
    ),
    (
        "product suggestion",
        lambda tmp: ParallelismConfig(dp_shard_size=2, tp_size=2).resolve(8),
        "set dp_shard_size=-1 (it becomes 4)",
    ),
    ("size zero", lambda tmp: ParallelismConfig(tp_size=0), "tp_size=0 is invalid"),
    ("negative size", lambda tmp: ParallelismConfig(cp_size=-2), "cp_size=-2 is invalid"),
    (
        "two -1",
        lambda tmp: ParallelismConfig(dp_shard_size=-1, dp_replicate_size=-1),
        "only one size may be -1, got dp_replicate_size and dp_shard_size",
    ),
    (
        "-1 does not divide",
        lambda tmp: ParallelismConfig(dp_shard_size=-1, tp_size=3).resolve(8),
        "dp_shard_size=-1 cannot fill world size 8: the other sizes multiply to 3",
    ),
    ("float size", lambda tmp: ParallelismConfig(tp_size=2.0), "tp_size=2.0 must be an integer"),
    ("bool size", lambda tmp: ParallelismConfig(tp_size=True), "tp_size=True must be an integer"),
    ("string size", lambda tmp: ParallelismConfig.from_dict({"tp_size": "two"}), "tp_size='two' must be an integer"),
    (
        "unknown key",
        lambda tmp: ParallelismConfig.from_dict({"tp_sise": 2}),
        "unknown parallelism field 'tp_sise'; did you mean 'tp_size'?",
    ),
    (
        "bad mixed precision",
        lambda tmp: ParallelismConfig(mixed_precision="bf61"),
        "mixed_precision='bf61' is not one of ['no', 'bf16', 'fp16']; did you mean 'bf16'?",
    ),
    (
        "bad rotate method",
        lambda tmp: ParallelismConfig(cp_rotate_method="ulysses"),
        "cp_rotate_method='ulysses' is not one of ['ring', 'allgather', 'alltoall']",
    ),
    (
        "bad bool",
        lambda tmp: ParallelismConfig(reshard_after_forward="yes"),
        "reshard_after_forward='yes' must be true or false",
    ),
    ("bad bucket", lambda tmp: ParallelismConfig(dp_bucket_mb=0), "dp_bucket_mb=0 must be a positive number"),
    ("offload without sharding", lambda tmp: ParallelismConfig(cpu_offload=True), "cpu_offload=true needs FSDP"),
    ("yaml list", lambda tmp: _bad_yaml(tmp, "- 1\n- 2\n")(), "the top level must be a mapping"),
    ("yaml syntax", lambda tmp: _bad_yaml(tmp, "tp_size: [1,\n")(), "invalid YAML"),
    (
        "yaml unsafe tag",
        lambda tmp: _bad_yaml(tmp, "tp_size: !!python/object/apply:os.system ['true']\n")(),
        "invalid YAML",
    ),
    ("missing file", lambda tmp: ParallelismConfig.from_yaml(tmp / "nope.yaml"), "does not exist"),
    ("bad override", lambda tmp: ParallelismConfig().with_overrides(["tp_size"]), "must look like key=value"),
    ("world size zero", lambda tmp: ParallelismConfig().resolve(0), "world size 0 must be a positive integer"),
    ("not a mapping", lambda tmp: ParallelismConfig.from_dict([1, 2]), "must be a mapping"),
    (
        "train batch vs dp",
        lambda tmp: TrainConfig.from_dict({"train": {"global_batch": 6}}).accumulation_steps(4),
        "train.global_batch=6 is not divisible by the data-parallel size 4",
    ),
    ("train unknown section", lambda tmp: TrainConfig.from_dict({"trian": {}}), "did you mean 'train'?"),
    (
        "train seq too long",
        lambda tmp: TrainConfig.from_dict({"data": {"seq_len": 4096}}),
        "data.seq_len=4096 exceeds model.max_seq_len=256",
    ),
    ("unknown preset", lambda tmp: TrainConfig.from_dict({"model": {"preset": "huge"}}), "unknown model preset 'huge'"),
    ("train lr text", lambda tmp: TrainConfig.from_dict({"train": {"lr": "abc"}}), "train.lr='abc' must be a number"),
    ("train betas", lambda tmp: TrainConfig.from_dict({"train": {"betas": [0.9]}}), "train.betas=[0.9] must be a list"),
    (
        "train negative clip",
        lambda tmp: TrainConfig.from_dict({"train": {"max_grad_norm": -1}}),
        "train.max_grad_norm=-1.0 must be >= 0",
    ),
    (
        "train negative router bias rate",
        lambda tmp: TrainConfig.from_dict({"train": {"router_bias_rate": -0.1}}),
        "train.router_bias_rate=-0.1 must be a finite number >= 0 (0: off)",
    ),
    ("train lr ratio", lambda tmp: TrainConfig.from_dict({"train": {"min_lr_ratio": 2}}), "must be between 0 and 1"),
    (
        "data seq text",
        lambda tmp: TrainConfig.from_dict({"data": {"seq_len": "abc"}}),
        "data.seq_len='abc' must be an integer",
    ),
    (
        "seq vs cp chunks",
        lambda tmp: TrainConfig.from_dict({"data": {"seq_len": 126}}).check_mesh(
            ParallelismConfig(cp_size=2).resolve(2)
        ),
        "data.seq_len 126 is not divisible by 2 x cp_size = 4 (cp_load_balance=true",
    ),
    (
        "seq vs tp",
        lambda tmp: TrainConfig.from_dict({"data": {"seq_len": 63}}).check_mesh(
            ParallelismConfig(tp_size=2).resolve(2)
        ),
        "data.seq_len 63 is not divisible by tp_size=2 (sequence parallel",
    ),
    (
        "fp16 without fsdp",
        lambda tmp: TrainConfig.from_dict({}).check_mesh(
            ParallelismConfig(dp_replicate_size=2, mixed_precision="fp16").resolve(2)
        ),
        "fp16 without FSDP",
    ),
    ("model unknown field", lambda tmp: TrainConfig.from_dict({"model": {"nlayers": 2}}), "did you mean 'n_layers'?"),
]


@pytest.mark.parametrize("make, fragment", [(m, f) for _, m, f in BAD_CONFIGS], ids=[d for d, _, _ in BAD_CONFIGS])
def test_bad_config_has_clear_error(tmp_path, make, fragment):
    with pytest.raises(ConfigError) as info:
        make(tmp_path)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_yaml_dict_round_trip(tmp_path):
    cfg = ParallelismConfig(
        dp_replicate_size=2,
        dp_shard_size=-1,
        tp_size=2,
        mixed_precision="bf16",
        cp_load_balance=False,
        dp_bucket_mb=12.5,
    )
    path = tmp_path / "cfg.yaml"
    cfg.to_yaml(path)
    assert ParallelismConfig.from_yaml(path) == cfg
    assert ParallelismConfig.from_dict(cfg.to_dict()) == cfg
    # A bare mapping (no section) reads the same.
    path.write_text("tp_size: 4\ndp_shard_size: -1\nmixed_precision: no\n")  # YAML 1.1 reads `no` as false
    assert ParallelismConfig.from_yaml(path) == ParallelismConfig(tp_size=4, dp_shard_size=-1)


def test_accelerate_names_yaml(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        "distributed_type: FSDP\n"  # other accelerate keys live outside the parallelism_config section
        "parallelism_config:\n"
        "  parallelism_config_dp_replicate_size: 2\n"
        "  parallelism_config_dp_shard_size: 2\n"
        "  parallelism_config_tp_size: 2\n"
        "  parallelism_config_cp_size: 1\n"
        "  parallelism_config_cp_comm_strategy: allgather\n"
    )
    cfg = ParallelismConfig.from_yaml(path)
    assert cfg.sizes == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert cfg.cp_rotate_method == "allgather"


def test_env_and_overrides():
    env = {
        "NDP_TP_SIZE": "2",
        "NDP_DP_SHARD_SIZE": "-1",
        "NDP_MIXED_PRECISION": "bf16",
        "PARALLELISM_CONFIG_CP_SIZE": "2",
        "NDP_UNRELATED": "x",
        "PATH": "/bin",
    }
    cfg = ParallelismConfig.from_env(env)
    assert (cfg.tp_size, cfg.dp_shard_size, cfg.cp_size, cfg.mixed_precision) == (2, -1, 2, "bf16")
    assert cfg.resolve(16).dp_shard_size == 4
    over = cfg.with_overrides(["tp_size=4", "reshard_after_forward=false", "cp_size=1"])
    assert (over.tp_size, over.reshard_after_forward, over.cp_size) == (4, False, 1)
    assert cfg.with_overrides({"cp_size": 1}).cp_size == 1


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    # YAML's safe loader reads 3e-4 (no dot) as a string; float fields accept it as the number.
    path = tmp_path / "train.yaml"
    path.write_text("train:\n  lr: 3e-4\nmodel:\n  preset: tiny\n  norm_eps: 1e-6\n")
    cfg = TrainConfig.from_yaml(path, ["train.weight_decay=1e-2"])
    assert (cfg.train.lr, cfg.model.norm_eps, cfg.train.weight_decay) == (3e-4, 1e-6, 1e-2)


def test_train_config_overrides(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("parallelism:\n  dp_shard_size: -1\nmodel:\n  preset: tiny\ntrain:\n  steps: 7\n")
    cfg = TrainConfig.from_yaml(path, ["train.steps=3", "tp_size=2", "model.n_layers=3", "train.micro_batch=2"])
    assert (cfg.train.steps, cfg.parallelism.tp_size, cfg.model.n_layers) == (3, 2, 3)
    assert cfg.accumulation_steps(dp_size=2) == 4  # 16 / 2 ranks / 2 per micro-batch
    assert TrainConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


# ------------------------------------------------------------------- environment, duplicates, precedence
def test_environment_variables_are_honoured_or_refused_by_name():
    from ndparallel.config.parallelism import environment_fields

    # Accelerate's sp_size is DeepSpeed-Ulysses sequence parallelism: refused, pointing at cp + alltoall.
    with pytest.raises(ConfigError, match=r"PARALLELISM_CONFIG_SP_SIZE=2: .*cp_size=2 and cp_rotate_method=alltoall"):
        environment_fields({"PARALLELISM_CONFIG_SP_SIZE": "2"})
    # sp_size 1 and its companions change nothing (as in Accelerate without sp).
    quiet = {"PARALLELISM_CONFIG_SP_SIZE": "1", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    assert environment_fields(quiet) == {}
    with pytest.raises(ConfigError, match=r"PARALLELISM_CONFIG_TP_SIZ is not a parallelism setting.*'tp_size'"):
        environment_fields({"PARALLELISM_CONFIG_TP_SIZ": "2"})
    assert environment_fields({"NDP_DEVICE": "cpu", "NDP_STORE_PATH": "/x"}) == {}, "other NDP_ settings"
    # Two names for one field: the same value is fine; different values are refused whatever the order.
    assert environment_fields({"NDP_TP_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2"}) == {"tp_size": 2}
    for env in (
        {"NDP_TP_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "2"},
        {"PARALLELISM_CONFIG_TP_SIZE": "2", "NDP_TP_SIZE": "4"},
    ):
        with pytest.raises(ConfigError, match=r"NDP_TP_SIZE=4 and PARALLELISM_CONFIG_TP_SIZE=2 both set tp_size"):
            environment_fields(env)
    alias = {"PARALLELISM_CONFIG_CP_COMM_STRATEGY": "allgather", "NDP_CP_ROTATE_METHOD": "ring"}
    with pytest.raises(ConfigError, match="both set cp_rotate_method"):
        environment_fields(alias)


def test_yaml_duplicate_keys_and_accelerate_sp_size_are_errors(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("parallelism:\n  tp_size: 2\n  cp_size: 1\n  tp_size: 4\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: duplicate key 'tp_size' on lines 2 and 4"):
        ParallelismConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="duplicate key 'train'"):
        TrainConfig.from_yaml(_write(tmp_path, "train:\n  steps: 2\ntrain:\n  steps: 3\n"))
    merged = _write(tmp_path, "base: &b {tp_size: 2}\nparallelism:\n  <<: *b\n  tp_size: 4\n")
    assert ParallelismConfig.from_yaml(merged).tp_size == 4, "a YAML merge key overrides on purpose"
    accelerate = _write(tmp_path, "parallelism_config:\n  parallelism_config_sp_size: 2\n")
    with pytest.raises(ConfigError, match="parallelism_config_sp_size=2: Accelerate's sp_size is DeepSpeed-Ulysses"):
        ParallelismConfig.from_yaml(accelerate)


def _write(tmp_path, text: str):
    path = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(text)
    return path


def test_precedence_file_then_environment_then_command_line(tmp_path):
    """Defaults < file < environment < command line, for ParallelismConfig and for ndparallel train's config."""
    path = _write(tmp_path, "parallelism:\n  tp_size: 2\n  cp_size: 2\ntrain:\n  steps: 7\n")
    env = {"NDP_TP_SIZE": "4", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "-1"}
    file = {"parallelism": {"tp_size": 2, "cp_size": 2}}
    assert ParallelismConfig.from_sources(file, {}).sizes == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 1,
        "cp": 2,
        "tp": 2,
    }
    assert ParallelismConfig.from_sources(file, env).sizes == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": -1,
        "cp": 2,
        "tp": 4,
    }
    assert ParallelismConfig.from_sources(file, env, ["tp_size=8"]).tp_size == 8
    cfg = TrainConfig.from_sources(path, ["train.steps=3"], env)
    assert (cfg.parallelism.tp_size, cfg.parallelism.cp_size, cfg.parallelism.dp_shard_size) == (4, 2, -1)
    assert cfg.train.steps == 3
    for override in ("tp_size=8", "parallelism.tp_size=8"):
        assert TrainConfig.from_sources(path, [override], env).parallelism.tp_size == 8, override
    assert TrainConfig.from_sources(None, [], env).parallelism.tp_size == 4, "no file: defaults < environment"
    assert TrainConfig.from_sources(path, [], {}).parallelism.tp_size == 2


def test_mesh_command_reads_the_environment(tmp_path, monkeypatch, capsys):
    """`NDP_TP_SIZE=4 ndparallel mesh CONFIG` used to print the file's tp size."""
    from ndparallel.launch.cli import main

    path = _write(tmp_path, "parallelism:\n  dp_shard_size: -1\n  tp_size: 2\n")
    monkeypatch.setenv("NDP_TP_SIZE", "4")
    assert main(["mesh", str(path), "--world-size", "8"]) == 0
    assert "mesh dp_shard=2 x tp=4" in capsys.readouterr().out
    assert main(["mesh", str(path), "--world-size", "8", "tp_size=8"]) == 0
    assert "mesh tp=8" in capsys.readouterr().out
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    assert main(["mesh", str(path), "--world-size", "8"]) == 2
    assert "NDP_TP_SIZE=4 and PARALLELISM_CONFIG_TP_SIZE=2 both set tp_size" in capsys.readouterr().err
