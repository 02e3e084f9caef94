"""Resuming a training job, per layout: a checkpoint of ``ndparallel train`` resumes bit-identically on the same
mesh and within 1e-10 (float64) on another mesh or in one process.

* dense (dp_shard 2): resumed on dp_shard 2, dp_shard 2 x tp 2 and one process, one spawned group each;
* pp (issue 13): ``ndparallel train`` with pp saves the stage lists and their optimizers; a step-2 checkpoint
  resumes on the same mesh, on another pp size, without pp and on an interleaved schedule, so the loop passes
  the stage lists and the learning-rate schedule, the data position and the RNG come back. All its jobs run
  in one 4-rank gloo group (each a separate ``train()`` call, as a user would run them).
"""

from __future__ import annotations

import os

import pytest
import torch

from ndparallel.testing import run_distributed
from tests.train.test_train import _config, _train


def _float64(config: dict) -> dict:
    config["model"]["dtype"] = "float64"
    return config


@pytest.mark.slow
def test_resume_is_exact_on_the_same_mesh_and_close_on_others(tmp_path):
    """float64: resuming on the same mesh is bit-identical; on another mesh or one process, within 1e-10."""
    ckpt = str(tmp_path / "ckpt")
    straight = run_distributed(_train, 2, _float64(_config({"dp_shard_size": 2}, ckpt, every=5, keep_last=5)))[0]
    assert sorted(os.listdir(ckpt)) == ["step-00000005", "step-00000010"]
    assert straight["losses"][-1] < straight["losses"][0]
    middle = f"{ckpt}/step-00000005"

    same = run_distributed(_train, 2, _float64(_config({"dp_shard_size": 2}, str(tmp_path / "a"), resume=middle)))[0]
    assert same["start_step"] == 5
    assert same["losses"] == straight["losses"][5:], "same mesh: identical losses"

    other_mesh = _float64(_config({"dp_shard_size": 2, "tp_size": 2}, str(tmp_path / "b"), resume=middle))
    other = run_distributed(_train, 4, other_mesh)
    single = run_distributed(_train, 1, _float64(_config({}, str(tmp_path / "c"), resume=middle)))
    for got in (other[0], single[0]):
        assert got["losses"] == pytest.approx(straight["losses"][5:], abs=1e-10)


def _pipeline_config(parallelism: dict, ckpt_dir: str, **checkpoint) -> dict:
    # n_layers 4: pp_size 4 and pp 2 x 2 stages per rank need a block per stage.
    return {
        "parallelism": parallelism,
        "model": {"preset": "tiny", "n_layers": 4, "max_seq_len": 64, "dtype": "float64"},
        "data": {"seq_len": 64, "max_bytes": 100_000},
        # warmup 2 of 4 steps: steps 3-4 run on the cosine part, so a resume that lost the schedule differs.
        "train": {
            "steps": 4,
            "global_batch": 8,
            "micro_batch": 2,
            "lr": 0.01,
            "warmup_steps": 2,
            "log_every": 100,
            "peak_tflops": 1.0,
        },
        "checkpoint": {"dir": ckpt_dir, "every": 2, "keep_last": 5, **checkpoint},
    }


RESUMED_MESHES = {
    "same": {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "1f1b"},
    "no_pp": {"pp_size": 1, "dp_shard_size": 4},
    "pp4": {"pp_size": 4, "pp_schedule": "1f1b"},
    "interleaved": {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2},
}


def _jobs(root: str) -> dict[str, dict]:
    from ndparallel.train import train
    from ndparallel.train.job_config import TrainConfig

    def run(config: dict) -> dict:
        result = train(TrainConfig.from_dict(config))
        return {"losses": result.losses, "start_step": result.start_step}

    results = {"straight": run(_pipeline_config(RESUMED_MESHES["same"], f"{root}/straight"))}
    middle = f"{root}/straight/step-00000002"
    for name, parallelism in RESUMED_MESHES.items():
        results[name] = run(_pipeline_config(parallelism, f"{root}/{name}", resume=middle))
    return results


def _tensors(checkpoint: str, tmp: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, flattened to ``a.b.c`` keys (read in this one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(tmp, weights_only=False))
    return flat


@pytest.mark.slow
def test_pp_resume_is_exact_on_the_same_mesh_and_across_pp_sizes_and_schedules(tmp_path):
    results = run_distributed(_jobs, 4, str(tmp_path), timeout=300)
    r0 = results[0]
    straight = r0["straight"]["losses"]
    assert len(straight) == 4 and straight[-1] < straight[0]
    assert sorted(os.listdir(tmp_path / "straight"))[:2] == ["step-00000002", "step-00000004"]
    for r in results[1:]:  # the pipeline's loss is the global mean on every rank
        assert r["straight"]["losses"] == straight

    same = r0["same"]
    assert same["start_step"] == 2
    assert same["losses"] == pytest.approx(straight[2:], abs=1e-10, rel=0)
    assert same["losses"] == straight[2:], "same mesh: bit-identical losses"
    final = _tensors(str(tmp_path / "straight" / "step-00000004"), str(tmp_path / "straight.pt"))
    resumed = _tensors(str(tmp_path / "same" / "step-00000004"), str(tmp_path / "same.pt"))
    assert final.keys() == resumed.keys() and any(".layers.3." in key for key in final)
    for key, tensor in final.items():
        assert torch.allclose(resumed[key], tensor, rtol=0, atol=1e-10), key
        assert torch.equal(resumed[key], tensor), f"same mesh: {key} bit-identical"

    for name in ("no_pp", "pp4", "interleaved"):
        got = r0[name]
        assert got["start_step"] == 2, name
        assert got["losses"] == pytest.approx(straight[2:], abs=1e-10, rel=0), name
