"""Hostile ``ndparallel plan`` input, in this process: ``--top 0`` (printed an empty table, exit 0), a pinned
``--ep`` that does not divide the experts (headlined "try --ac full"), and the headline when every shape is
refused by a rule rather than by memory."""

from __future__ import annotations

from ndparallel.estimate.cli import main as plan_main

MOE = ["plan", "--model", "tiny-moe", "--gpus", "8", "--seq", "64", "--global-batch", "16", "--no-pp"]


def test_top_0_and_an_ep_that_does_not_divide_the_experts_are_refused_first(capsys):
    assert plan_main([*MOE, "--top", "0"]) == 2
    assert "ndparallel plan: error: --top=0 would print no shape: give --top 1 or more" in capsys.readouterr().err
    assert plan_main([*MOE, "--ep", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ndparallel plan: error: --ep 8 does not divide the model's 4 experts") and "--ac" not in err


def test_no_shape_fits_leads_with_the_rule_when_none_failed_for_memory(capsys):
    assert plan_main([*MOE, "--ep", "2", "--tp", "8"]) == 1
    out = capsys.readouterr().out
    assert "no mesh shape fits: each is refused, none for memory; most often: ep_size=2 does not divide" in out
    assert "--ac full" not in out


def test_stages_per_rank_the_schedule_cannot_run_is_the_configs_refusal(capsys):
    """``--pp-stages-per-rank 2`` with 1f1b crashed in the activation model (a ValueError from zip)."""
    argv = ["plan", "--model", "8b", "--gpus", "8", "--pp", "2", "--pp-schedule", "1f1b", "--pp-stages-per-rank", "2"]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ndparallel plan: error: pp_stages_per_rank=2 does not fit pp_schedule='1f1b'"), err
