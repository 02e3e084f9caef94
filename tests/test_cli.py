"""The ndparallel command: mesh validation, torchrun-backed launch, failure propagation."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from ndparallel.cli import _torchrun_argv, main
from tests.command import run_ndparallel


def test_mesh_prints_rank_layout(capsys):
    assert main(["mesh", "configs/demo.yaml", "--world-size", "8", "tp_size=2"]) == 0
    out = capsys.readouterr().out
    assert "mesh dp_shard=4 x tp=2  (world size 8" in out
    assert "tp                                       size 2    groups: [0,1] [2,3] [4,5] [6,7]" in out


def test_mesh_errors_are_one_line(capsys):
    assert main(["mesh", "configs/demo.yaml"]) == 2
    assert "pass --world-size N" in capsys.readouterr().err
    assert main(["mesh", "configs/demo.yaml", "--world-size", "4", "tp_size=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ndparallel: error: dp_shard_size=-1 cannot fill world size 4")
    assert "Traceback" not in err


def test_train_with_cpu_ranks_checks_the_config_before_spawning():
    result = run_ndparallel("train", "--config", "configs/demo.yaml", "--cpu-ranks", "4", "dp_shard_size=1", timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("ndparallel: error: mesh sizes multiply to 2 (tp_size=2) but the world size is 4") == 1
    assert "torchelastic" not in result.stderr, "no process was started"
    # --resume without checkpoint.dir, and --steps 0: also caught before spawning, once.
    for extra, message in [
        (["--resume"], "checkpoint.resume=true need checkpoint.dir"),
        (["--steps", "0"], "train.steps=0"),
    ]:
        result = run_ndparallel("train", "--config", "configs/demo.yaml", "--cpu-ranks", "4", *extra, timeout=60)
        assert result.returncode == 2 and result.stderr.count(message) == 1, result.stderr[-2000:]


def test_launch_translates_to_torchrun_arguments(monkeypatch):
    monkeypatch.delenv("NDP_DEVICE", raising=False)
    argv = _torchrun_argv(["--cpu-ranks", "4", "--max-restarts", "1", "--", "train", "--config", "x.yaml"])
    assert argv == [
        "--max-restarts",
        "1",
        "--nproc-per-node",
        "4",
        "--standalone",
        "-m",
        "ndparallel",
        "train",
        "--config",
        "x.yaml",
    ]
    assert os.environ["NDP_DEVICE"] == "cpu"
    assert _torchrun_argv(["--cpu-ranks=2", "--", "s.py"]) == ["--nproc-per-node", "2", "--standalone", "s.py"]
    multi = _torchrun_argv(["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-endpoint", "h:29400", "--", "s.py"])
    assert multi == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-endpoint", "h:29400", "s.py"]
    from ndparallel import ConfigError

    with pytest.raises(ConfigError, match="needs `--`"):
        _torchrun_argv(["--cpu-ranks", "2", "train"])
    with pytest.raises(ConfigError, match="positive integer"):
        _torchrun_argv(["--cpu-ranks", "x", "--", "train"])


def test_launch_runs_a_script_on_real_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():.0f}", flush=True)
        dist.destroy_process_group()
    """)
    )
    result = run_ndparallel("launch", "--cpu-ranks", "3", "--", str(script))
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert f"rank {rank} of 3 sum 6" in result.stdout


def test_launch_crashing_rank_takes_the_job_down(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent("""
        import time, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise RuntimeError("rank one exploded on purpose")
        time.sleep(120)  # the others would wait far longer than the test allows
    """)
    )
    start = time.monotonic()
    result = run_ndparallel("launch", "--cpu-ranks", "3", "--", str(script), timeout=90)
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    combined = result.stdout + result.stderr
    assert "rank one exploded on purpose" in combined
    assert "rank 1 failed first" in result.stderr
