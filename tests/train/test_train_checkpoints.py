"""The training job and its checkpoint folder (issue 11): a diverging job stops and keeps its good
checkpoints, --resume says when there is nothing to resume, one job per folder (a lock), and a bad
folder or resume path is one line before any rank starts.

The trainer runs on 2 real gloo ranks (several jobs in one spawned group); the CLI checks run
``ndparallel.launch.cli.main`` in this process where they must end before any rank is spawned.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ndparallel.checkpoint.lock import CheckpointDirLock
from ndparallel.testing import run_distributed
from tests.command import run_ndparallel


def _config(ckpt_dir: str | None, **sections: dict) -> dict:
    config = {
        "parallelism": {"dp_shard_size": 2},
        "model": {"preset": "tiny", "max_seq_len": 64},
        "data": {"seq_len": 64, "max_bytes": 100_000},
        # peak_tflops: skip the CPU matmul measurement of the MFU denominator in every train() call
        "train": {"steps": 2, "global_batch": 4, "lr": 0.01, "warmup_steps": 0, "log_every": 100, "peak_tflops": 1.0},
        "checkpoint": {"dir": ckpt_dir, "every": 1, "keep_last": 2},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def _run(config: dict) -> dict[str, Any]:
    """Train ``config`` on this rank; what it printed, its error (type and message) and its losses."""
    from ndparallel.train import train
    from ndparallel.train.job_config import TrainConfig

    out, error, losses = io.StringIO(), None, []
    with contextlib.redirect_stdout(out):
        try:
            losses = train(TrainConfig.from_dict(config)).losses
        except Exception as e:
            error = (type(e).__name__, str(e))
    return {"out": out.getvalue(), "error": error, "losses": losses}


def _checkpoints(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("step-"))


def _jobs(root: str) -> dict[str, dict[str, Any]]:
    """Several training jobs in one 2-rank group (each a separate train() call, as a user would run them)."""
    run = f"{root}/run"
    results = {"first": _run(_config(run))}  # step-1, step-2 (keep_last=2)
    results["nothing_to_resume"] = _run(_config(f"{root}/empty", checkpoint={"resume": True}, train={"steps": 1}))
    # lr 1e30: the update of step 3 is huge, so the gradient norm of step 4 is NaN.
    diverging = {"steps": 8, "lr": 1e30}
    results["diverged"] = _run(_config(run, checkpoint={"resume": True, "every": 2}, train=diverging))
    results["after_diverged"] = _checkpoints(run)
    patient = {**diverging, "max_nonfinite_steps": 3}
    results["patient"] = _run(_config(run, checkpoint={"resume": True, "every": 2}, train=patient))
    results["after_patient"] = _checkpoints(run)
    results["locked"] = _run(_config(f"{root}/locked"))
    results["other_preset"] = _run(
        _config(f"{root}/other", checkpoint={"resume": f"{run}/step-00000002"}, model={"n_layers": 3})
    )
    return results


def test_diverging_job_stops_keeps_good_checkpoints_and_one_job_per_folder(tmp_path):
    with CheckpointDirLock(tmp_path / "locked"):  # another live job (this test process) holds the folder
        r0, r1 = run_distributed(_jobs, 2, str(tmp_path), timeout=240)
    assert r0["first"]["error"] is None and _checkpoints(tmp_path / "run") == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "run" / "ndparallel.lock").exists(), "every job released its lock"

    # --resume with nothing to resume says so (and trains from step 0).
    assert r0["nothing_to_resume"]["error"] is None
    assert "nothing to resume" in r0["nothing_to_resume"]["out"]

    # A NaN gradient norm at step 4 stops every rank with the same error; step 4 is not saved and the
    # finite step-1 / step-2 are not pruned. With max_nonfinite_steps=3 the bad steps are skipped
    # (no update) until the third in a row.
    for r in (r0, r1):
        kind, message = r["diverged"]["error"]
        assert kind == "DivergenceError", r["diverged"]
        assert "training stopped at step 4" in message and "rank(s) [0, 1]" in message
        assert r["after_diverged"] == ["step-00000001", "step-00000002"]
        assert r["patient"]["error"][0] == "DivergenceError"
        assert (
            "training stopped at step 6" in r["patient"]["error"][1]
            and "3 step(s) in a row" in r["patient"]["error"][1]
        )
        assert r["after_patient"] == ["step-00000001", "step-00000002"]
    assert len(r0["diverged"]["losses"]) == 0, "train() raised: no result"
    assert "update skipped" in r0["patient"]["out"]

    # A second job into a folder another live job holds is refused on every rank, naming the holder.
    for r in (r0, r1):
        kind, message = r["locked"]["error"]
        assert kind == "CheckpointError" and f"pid {os.getpid()} on host" in message, message
        assert "in use by another job" in message
    assert not (tmp_path / "locked" / "step-00000001").exists()

    # Resuming from a checkpoint of another model: the same one-line CheckpointError on both ranks.
    assert r0["other_preset"]["error"] == r1["other_preset"]["error"]
    assert "does not fit the model" in r0["other_preset"]["error"][1]


def test_stale_lock_is_taken_over_and_a_live_one_refused(tmp_path):
    folder = tmp_path / "ckpt"
    # A job that died holding the lock (a forked child that exits without releasing it).
    pid = os.fork()
    if pid == 0:  # the child: take the lock, then die as a killed job would
        try:
            CheckpointDirLock(folder).acquire()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    holder = json.loads((folder / "ndparallel.lock").read_text())
    assert holder["pid"] == pid
    with pytest.warns(UserWarning, match=f"took over the stale lock .*pid {pid} .* is no longer running"):
        lock = CheckpointDirLock(folder)
        lock.acquire()
    assert json.loads((folder / "ndparallel.lock").read_text())["pid"] == os.getpid()
    from ndparallel.errors import CheckpointError

    with pytest.raises(CheckpointError, match=f"in use by another job: pid {os.getpid()} on host"):
        CheckpointDirLock(folder).acquire()
    lock.release()
    assert not (folder / "ndparallel.lock").exists()
    CheckpointDirLock(folder).acquire()  # free again


# ----------------------------------------------------------------------------- CLI: one line, before any rank


@contextlib.contextmanager
def _read_only(folder: Path):
    """``folder`` made read-only for this process (chmod; as root, which ignores modes, chattr +i)."""
    folder.chmod(0o555)
    immutable = False
    try:
        if os.access(folder, os.W_OK) and os.geteuid() == 0 and shutil.which("chattr"):
            immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        try:
            (folder / "probe").touch()
        except OSError:
            pass
        else:
            (folder / "probe").unlink()
            pytest.skip("cannot make a read-only folder here (root without chattr +i)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_cli_refuses_a_bad_checkpoint_folder_or_resume_path_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    from ndparallel import checkpoint
    from ndparallel.launch import cli
    from ndparallel.models import Transformer, TransformerConfig

    def no_spawn(argv):
        raise AssertionError(f"ranks were started: {argv}")

    monkeypatch.setattr(cli, "launch", no_spawn)
    good = Path(checkpoint.save(tmp_path / "good", Transformer(TransformerConfig.from_preset("tiny")), step=1))
    shard = next(p.name for p in good.iterdir() if p.suffix == ".distcp")
    variants = {}
    for name, damage in [
        ("truncated", lambda p: os.truncate(p / shard, 100)),
        ("no-metadata", lambda p: (p / ".metadata").unlink()),
        ("future", lambda p: _set_marker(p, format_version=99)),
    ]:
        shutil.copytree(good, tmp_path / name)
        damage(tmp_path / name)
        variants[name] = tmp_path / name
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "read-only").mkdir()
    CheckpointDirLock(tmp_path / "busy").acquire()
    base = ["train", "--cpu-ranks", "2", "dp_shard_size=2", "train.steps=1"]
    cases = [
        ([f"checkpoint.dir={tmp_path / 'a-file'}"], "is a file, not a folder"),
        ([f"checkpoint.dir={tmp_path / 'busy'}"], f"in use by another job: pid {os.getpid()}"),
        ([f"checkpoint.resume={tmp_path / 'missing'}"], "no checkpoint directory at"),
        ([f"checkpoint.resume={variants['truncated']}"], "truncated or modified"),
        ([f"checkpoint.resume={variants['no-metadata']}"], "'.metadata' listed in ndparallel_meta.json is missing"),
        ([f"checkpoint.resume={variants['future']}"], "format_version 99; this ndparallel reads versions"),
    ]
    for extra, message in cases:
        assert cli.main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("ndparallel: error: ") and err.count("\n") == 1, err
        assert message in err, (message, err)
    with _read_only(tmp_path / "read-only"):
        assert cli.main([*base, f"checkpoint.dir={tmp_path / 'read-only'}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not writable" in err, err


def _set_marker(path: Path, **fields) -> None:
    marker = json.loads((path / "ndparallel_meta.json").read_text())
    marker.update(fields)
    (path / "ndparallel_meta.json").write_text(json.dumps(marker))


@pytest.mark.jobs  # a full torchrun launch of 2 ranks, and one single-process job
def test_cli_prints_errors_raised_inside_ranks_as_one_line(tmp_path):
    """Resuming a checkpoint into another model, on 2 real ranks under torchrun: one line per rank, no
    traceback. A diverging single-process job: one line, exit code 1."""
    import torch

    from ndparallel import checkpoint
    from ndparallel.models import Transformer, TransformerConfig

    small = Transformer(TransformerConfig.from_preset("tiny", n_layers=1))
    saved = checkpoint.save(tmp_path / "small", small, torch.optim.AdamW(small.parameters()))
    start = time.monotonic()
    result = run_ndparallel(
        "train",
        "--cpu-ranks",
        "2",
        "dp_shard_size=2",
        "train.steps=1",
        "train.global_batch=2",
        "data.max_bytes=100000",
        f"checkpoint.resume={saved}",
        timeout=180,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "ndparallel: error:" in line]
    # One line per rank that got to print it (torchrun may stop rank 1 first), never two glued together.
    assert 1 <= len(errors) <= 2, result.stderr[-3000:]
    assert all(line.count("ndparallel: error:") == 1 and "does not fit the model" in line for line in errors)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    print(f"2-rank CLI run with an error inside the ranks took {time.monotonic() - start:.1f}s")

    result = run_ndparallel(
        "train",
        "train.steps=5",
        "train.global_batch=2",
        "train.lr=1e30",
        "train.peak_tflops=1",
        "data.max_bytes=100000",
        f"checkpoint.dir={tmp_path / 'diverged'}",
        timeout=180,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("ndparallel: error:")]
    assert len(errors) == 1 and "training stopped at step 2" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "diverged" / "step-00000002").exists()
