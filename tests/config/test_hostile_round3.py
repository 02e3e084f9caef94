"""Hardening round 3, config and messages, in this process: every unknown YAML field at once (and
``model.ep_size`` pointed at ``parallelism.ep_size``), ``model.expert_ffn_dim`` <= 0 at the pre-flight, a memory
refusal under ``--cpu-ranks 2`` counting 2 ranks, ``NDP_PP_SIZE=3`` on 2 ranks naming the variable, and
``model.aux_loss_coef=1e300`` stopping with the coefficient named (it advised lowering the lr)."""

from __future__ import annotations

import pytest

from ndparallel.config.parallelism import CPU_RANKS_ENV
from ndparallel.errors import ConfigError, DivergenceError
from ndparallel.train.job_config import TrainConfig


def test_every_unknown_field_is_named_at_once_with_where_it_belongs():
    data = {"model": {"ep_size": 2, "nlayers": 2}, "train": {"stepz": 3}, "parallelism": {"tp_sise": 2}}
    with pytest.raises(ConfigError) as caught:
        TrainConfig.from_dict(data)
    message = str(caught.value)
    for part in (
        "unknown fields model.ep_size (it belongs in parallelism.ep_size)",
        "model.nlayers (did you mean 'n_layers'?)",
        "train.stepz (did you mean 'steps'?)",
        "parallelism.tp_sise (did you mean 'tp_size'?)",
    ):
        assert part in message, message
    with pytest.raises(ConfigError, match=r"^unknown field train.preset \(it belongs in model.preset\): fix or"):
        TrainConfig.from_dict({"train": {"preset": "tiny"}})


@pytest.mark.parametrize("width", [0, -4])
def test_a_non_positive_expert_width_is_refused_at_the_preflight(width):
    with pytest.raises(ConfigError, match=rf"model.expert_ffn_dim={width} must be a positive integer"):
        TrainConfig.from_dict({"model": {"preset": "tiny-moe", "expert_ffn_dim": width}})


def test_cpu_ranks_refusals_count_the_ranks_and_name_the_environment(monkeypatch, capsys):
    from ndparallel.launch.cli import main

    monkeypatch.delenv(CPU_RANKS_ENV, raising=False)  # main sets it; restored after the test
    monkeypatch.delenv("NDP_DEVICE", raising=False)
    assert main(["train", "--cpu-ranks", "2", "model.max_seq_len=1000000000000"]) == 2
    assert "on each of this machine's 2 rank(s)" in capsys.readouterr().err  # it said 1 rank(s)
    monkeypatch.setenv("NDP_PP_SIZE", "3")
    assert main(["train", "--cpu-ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert "NDP_PP_SIZE=3 in the environment sets pp_size" in err and "pp_size = 3 must divide the world size 2" in err
    assert "micro-batch" not in err, err


def test_an_overflowing_router_loss_names_its_coefficient():
    from ndparallel.distributed.process import destroy_distributed
    from ndparallel.train import train

    cfg = TrainConfig.from_dict({
        "model": {"preset": "tiny-moe", "aux_loss_coef": 1e300, "n_layers": 1, "dtype": "float32"},
        "train": {"steps": 1, "global_batch": 2},
        "data": {"seq_len": 16, "max_bytes": 4096},
    })  # fmt: skip
    try:
        with pytest.raises(DivergenceError) as caught:
            train(cfg)
    finally:
        destroy_distributed()
    message = str(caught.value)
    assert "the router losses are inf while the cross entropy is" in message and "aux_loss_coef=1e+300" in message
    assert message.endswith(
        "Lower model.aux_loss_coef / model.z_loss_coef (the router losses overflowed, not the model)"
    )  # noqa: E501
