"""The ndparallel command: mesh validation, torchrun-backed launch, failure propagation."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from ndparallel.launch.cli import _torchrun_argv, main
from tests.command import run_ndparallel

pytestmark = pytest.mark.jobs  # real launchers, torchrun, CLI processes or signals: not in make test-fast


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
    import sys

    from ndparallel.launch.torchrun import WORKER_GUARD

    for name in ("NDP_DEVICE", "NDP_CPU_RANKS", "OMP_NUM_THREADS"):  # torchrun_argv sets them: restored afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    # Every worker starts through the guard (dies with its launcher), in torchrun's --no-python form.
    guard = [sys.executable, "-I", str(WORKER_GUARD)]
    argv = _torchrun_argv(["--cpu-ranks", "4", "--max-restarts", "1", "--", "train", "--config", "x.yaml"])
    assert argv == [
        "--max-restarts",
        "1",
        "--nproc-per-node",
        "4",
        "--standalone",
        "--no-python",
        *guard,
        "python",
        "-m",
        "ndparallel",
        "train",
        "--config",
        "x.yaml",
    ]
    assert os.environ["NDP_DEVICE"] == "cpu"
    assert _torchrun_argv(["--cpu-ranks=2", "--", "s.py"]) == [
        "--nproc-per-node",
        "2",
        "--standalone",
        "--no-python",
        *guard,
        "python",
        "s.py",
    ]
    multi = _torchrun_argv(["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-endpoint", "h:29400", "--", "s.py"])
    assert multi == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-endpoint", "h:29400", "--no-python"] + [
        *guard,
        "python",
        "s.py",
    ]
    # torchrun's own -m and --no-python become the guard's modes.
    assert _torchrun_argv(["-m", "--", "pkg.mod", "a"])[-5:] == [str(WORKER_GUARD), "python", "-m", "pkg.mod", "a"]
    assert _torchrun_argv(["--no-python", "--", "./run.sh"])[-3:] == [str(WORKER_GUARD), "exec", "./run.sh"]
    from ndparallel import ConfigError

    with pytest.raises(ConfigError, match="needs `--`"):
        _torchrun_argv(["--cpu-ranks", "2", "train"])
    with pytest.raises(ConfigError, match="positive integer"):
        _torchrun_argv(["--cpu-ranks", "x", "--", "train"])
    with pytest.raises(ConfigError, match="--cpu-ranks=0 must be >= 1"):
        _torchrun_argv(["--cpu-ranks", "0", "--", "train"])


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


def test_launch_names_the_python_frame_of_a_rank_that_segfaults(tmp_path):
    script = tmp_path / "segfault.py"
    script.write_text(
        textwrap.dedent("""
        import ctypes, time, torch.distributed as dist
        dist.init_process_group("gloo")
        def read_address_zero():
            ctypes.string_at(0)  # a real native crash
        if dist.get_rank() == 1:
            read_address_zero()
        time.sleep(120)
    """)
    )
    result = run_ndparallel("launch", "--cpu-ranks", "2", "--", str(script), timeout=90)
    assert result.returncode != 0
    assert "rank 1 failed first" in result.stderr, result.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in result.stderr, result.stderr[-3000:]
    assert "in read_address_zero" in result.stderr, result.stderr[-3000:]


# ------------------------------------------------------------------ hostile input: one line, before any rank
def _one_line_error(capsys, argv: list[str], fragment: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ndparallel: error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    return err


def test_bad_config_files_are_one_line_errors(tmp_path, capsys):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    _one_line_error(capsys, ["train", "--config", str(binary)], "is not a text file")
    _one_line_error(capsys, ["mesh", str(binary), "--world-size", "1"], "is not a text file")
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 200_000 + "]" * 200_000 + "\n")
    _one_line_error(capsys, ["train", "--config", str(deep)], "nested too deeply")
    folder = tmp_path / "configs"
    folder.mkdir()
    _one_line_error(capsys, ["train", "--config", str(folder)], "is a folder, not a YAML file")
    _one_line_error(capsys, ["train", "--config", str(tmp_path / "missing.yaml")], "does not exist")


def test_bad_sizes_devices_and_rank_counts_are_refused_early(tmp_path, capsys, monkeypatch):
    import torch

    _one_line_error(capsys, ["train", "--cpu-ranks", "0"], "--cpu-ranks=0 must be >= 1")
    _one_line_error(capsys, ["train", "model.max_seq_len=1000000000000"], "model.max_seq_len=1000000000000")
    _one_line_error(capsys, ["train", "train.timeout_s=0"], "train.timeout_s=0")
    config = tmp_path / "nan.yaml"
    config.write_text("parallelism:\n  dp_bucket_mb: .nan\n")
    _one_line_error(capsys, ["mesh", str(config), "--world-size", "1"], "dp_bucket_mb=nan")
    monkeypatch.setenv("NDP_DEVICE", "tpu")
    _one_line_error(capsys, ["train"], "NDP_DEVICE='tpu' must be cpu or cuda")
    monkeypatch.delenv("NDP_DEVICE")
    if not torch.cuda.is_available():
        _one_line_error(capsys, ["train", "train.device=cuda"], "CUDA is not available")
        _one_line_error(capsys, ["train", "--device", "cuda"], "CUDA is not available")


def test_timeout_flag_sets_the_config_field():
    from ndparallel.launch.cli import _parser, _train_config

    args = _parser().parse_args(["train", "--timeout", "42"])
    assert _train_config(args).train.timeout_s == 42.0


def test_resuming_a_finished_run_says_so(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [
        "train.steps=2",
        "data.max_bytes=20000",
        "data.seq_len=32",
        "train.global_batch=2",
        f"checkpoint.dir={ckpt}",
    ]
    script = (
        "import sys\nfrom ndparallel.launch.cli import main\n"
        f"assert main(['train', *{common!r}]) == 0\n"
        "print('---', flush=True)\n"
        f"sys.exit(main(['train', '--resume', *{common!r}]))\n"
    )
    import subprocess
    import sys

    from tests.command import REPO, clean_env

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    second = result.stdout.split("---", 1)[1]
    assert "done: nothing to train: resumed at step 2, and train.steps=2" in second, second
