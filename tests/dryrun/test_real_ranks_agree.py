"""The dry run against the real thing: the same job on 4 real gloo ranks and on the fake world of 4.

Each real rank runs the engine (:func:`ndparallel.dryrun.engine.measure_rank`) on real tensors; the dry run
runs it on fake tensors and the fake process group. Parameter, gradient and optimizer bytes at the peak are
equal, the activation peak is within 5%, and the collectives are the same (dimension, kind, calls; bytes but
for a few in one all-reduce under pp), as are the FLOPs and the peak's module and phase.
Two meshes share one spawned group: FSDP x TP with bf16 mixed precision and accumulation, and pp x FSDP.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from ndparallel.dryrun.engine import measure_rank
from ndparallel.dryrun.models import dry_run_model
from ndparallel.dryrun.run import dry_run
from ndparallel.testing import run_distributed
from ndparallel.train.job_config import TrainConfig

pytestmark = pytest.mark.slow  # 4 real gloo ranks and two dry runs: 60-80 s on 2 loaded cores

JOB = ["model.preset=tiny", "data.seq_len=32", "model.max_seq_len=32", "train.global_batch=8"]
MESHES = {
    "fsdp2_tp2_bf16_accum2": [*JOB, "dp_shard_size=2", "tp_size=2", "mixed_precision=bf16", "train.micro_batch=2"],
    "pp2_fsdp2_1f1b": [*JOB, "pp_size=2", "dp_shard_size=2", "activation_checkpointing=full"],
}


def _config(overrides: list[str]) -> TrainConfig:
    return TrainConfig.from_sources(None, overrides, {}, host_checks=False)


def _real_rank(meshes: dict[str, list[str]]) -> dict[str, dict]:
    """One real gloo rank: every mesh's measured step, as dicts."""
    out = {}
    for name, overrides in meshes.items():
        cfg = _config(overrides)
        out[name] = asdict(measure_rank(cfg, dry_run_model(cfg)[1], fake=False))
    return out


@pytest.fixture(scope="module")
def real() -> list[dict[str, dict]]:
    return run_distributed(_real_rank, 4, MESHES)


def _comms(rank: dict) -> list[tuple]:
    return [(c["dim"], c["kind"], c["group_size"], c["calls"]) for c in rank["comms"]]


def _comm_bytes(rank: dict) -> list[int]:
    return [c["bytes"] for c in rank["comms"]]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_dry_run_matches_real_gloo_ranks(real, mesh):
    report = dry_run(_config(MESHES[mesh]), 4)
    for fake in report.ranks:
        got = asdict(fake)
        want = real[fake.rank][mesh]
        for kind in ("params", "grads", "optimizer"):
            assert got["peak_by_kind"][kind] == want["peak_by_kind"][kind], (mesh, fake.rank, kind)
        assert got["activation_peak_bytes"] == pytest.approx(want["activation_peak_bytes"], rel=0.05)
        assert got["peak_bytes"] == pytest.approx(want["peak_bytes"], rel=0.05)
        assert _comms(got) == _comms(want), (mesh, fake.rank)
        # Equal but for one all-reduce under pp: the gradient-presence flags clipping agrees on are as long as the
        # longest stage's parameter list, which the dry run takes as its own (each rank alike): a few bytes.
        assert _comm_bytes(got) == pytest.approx(_comm_bytes(want), rel=0.05, abs=64), (mesh, fake.rank)
        assert got["flops"] == want["flops"]
        assert (got["peak_module"], got["peak_phase"]) == (want["peak_module"], want["peak_phase"])
