"""The training job: the loop against one process, a SIGINT or SIGKILLed rank, torchrun restarts, the demo,
a pipeline job's defer_grad_sync check (resume exactness across layouts: tests/train/test_resume.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ndparallel.launch.torchrun import children_of
from ndparallel.testing import run_distributed
from ndparallel.train.job_config import TrainConfig
from tests.command import run_ndparallel, start_ndparallel


def _config(parallelism: dict, ckpt_dir: str, **checkpoint) -> dict:
    return {
        "parallelism": parallelism,
        "model": {"preset": "tiny", "max_seq_len": 64},
        "data": {"seq_len": 64, "max_bytes": 300_000},
        "train": {"steps": 10, "global_batch": 8, "lr": 0.01, "warmup_steps": 2, "log_every": 100},
        "checkpoint": {"dir": ckpt_dir, **checkpoint},
    }


def test_learning_rate_schedule():
    from ndparallel.train.loop import lr_at

    cfg = TrainConfig.from_dict({"train": {"steps": 10, "lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1}})
    lrs = [lr_at(step, cfg) for step in range(10)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]), "linear warmup, never 0 at step 0"
    assert lrs[4] == pytest.approx(1.0), "cosine starts at the peak"
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:], strict=False)), "then decays monotonically"
    assert lr_at(10, cfg) == pytest.approx(0.1), "reaching lr x min_lr_ratio at train.steps"
    no_warmup = TrainConfig.from_dict({"train": {"steps": 4, "lr": 1.0, "warmup_steps": 0}})
    assert lr_at(0, no_warmup) == pytest.approx(1.0)


def test_an_explicit_false_defer_grad_sync_is_refused_under_pp():
    """torch's pipeline stage reduce-scatters FSDP gradients once per step, so ``defer_grad_sync: false`` (sync
    every micro-batch) cannot be honoured under pp with FSDP: refused by name; unset and true are accepted (and
    false without FSDP, where the field does nothing, as without pp)."""
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.errors import ConfigError
    from tests.train.test_resume import _pipeline_config as _config  # the pipeline job's config

    sizes = ParallelismConfig(pp_size=2, dp_shard_size=2, pp_schedule="1f1b")
    for defer in (None, True):
        config = _config({}, "unused")
        config["train"]["defer_grad_sync"] = defer
        assert TrainConfig.from_dict(config).check_mesh(sizes) == 2
    config = _config({}, "unused")
    config["train"]["defer_grad_sync"] = False
    with pytest.raises(ConfigError, match=r"train\.defer_grad_sync=false cannot be honoured with pp_size=2"):
        TrainConfig.from_dict(config).check_mesh(sizes)
    assert TrainConfig.from_dict(config).check_mesh(ParallelismConfig(dp_shard_size=4)) == 1  # fine without pp
    no_fsdp = ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_schedule="1f1b")  # replicate: always deferred
    assert TrainConfig.from_dict(config).check_mesh(no_fsdp) == 2


def _train(config: dict) -> dict:
    from ndparallel.train import train

    result = train(TrainConfig.from_dict(config))
    return {"losses": result.losses, "start_step": result.start_step, "interrupted": result.interrupted}


def _train_many(configs: list[dict]) -> list[dict]:
    from ndparallel.train import train

    results = []
    for config in configs:
        result = train(TrainConfig.from_dict(config))
        results.append({"losses": result.losses, "grad_norms": result.grad_norms})
    return results


def test_train_loop_on_4_ranks_matches_one_process(tmp_path):
    """The whole job (data slicing, accumulation, cp sharding, clipping, loss averaging, lr schedule) in
    float64 (model.dtype) within 1e-10 of one process, with gradients reduce-scattered every micro-batch (the
    default) and deferred to the last (train.defer_grad_sync), and bf16 on a mesh without FSDP (the loop's
    autocast) against bf16 in one process."""
    configs = []
    for parallelism, dtype, defer in (
        ({"dp_shard_size": 2, "cp_size": 2}, "float64", False),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, "float64", False),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, "float64", True),
        ({"dp_replicate_size": 2, "tp_size": 2, "mixed_precision": "bf16"}, "float32", False),
    ):
        config = _config(parallelism, None)
        config["model"]["dtype"] = dtype
        # 8 / dp 2 / 2 = 2 micro-batches
        config["train"].update(steps=4, micro_batch=2, max_grad_norm=0.5, defer_grad_sync=defer)
        configs.append(config)
    singles = []
    for precision, dtype in (("no", "float64"), ("bf16", "float32")):
        single = _config({"mixed_precision": precision}, None)
        single["model"]["dtype"] = dtype
        single["train"].update(steps=4, max_grad_norm=0.5)
        singles.append(single)
    reference, reference_bf16 = run_distributed(_train_many, 1, singles)[0]
    assert reference["grad_norms"][0] > 0.5, "clipping must be active"
    fsdp_cp, hsdp, hsdp_deferred, replicate_tp_bf16 = run_distributed(_train_many, 4, configs)[0]
    for got in (fsdp_cp, hsdp, hsdp_deferred):
        assert got["losses"] == pytest.approx(reference["losses"], abs=1e-10)
        assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-10)
    # bf16: same recipe in both, different reduction order -> a looser, stated tolerance.
    assert replicate_tp_bf16["losses"] == pytest.approx(reference_bf16["losses"], abs=2e-2)
    assert replicate_tp_bf16["losses"] != reference["losses"], "bf16 autocast must actually be on"


def _train_until_signalled(config: dict, metrics: str) -> dict:
    """Rank 0 receives SIGINT (as from Ctrl-C) once 3 steps are logged; rank 1 never does."""
    import threading

    import torch.distributed as dist

    if dist.get_rank() == 0:

        def interrupt() -> None:
            while not (os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 3):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
    return _train(config)


@pytest.mark.jobs
def test_sigint_on_one_rank_stops_all_ranks_together_after_saving(tmp_path):
    config = _config({"dp_shard_size": 2}, str(tmp_path / "ckpt"))
    config["train"].update(steps=100_000, metrics_file=str(tmp_path / "m.jsonl"))
    results = run_distributed(_train_until_signalled, 2, config, str(tmp_path / "m.jsonl"), timeout=180)
    steps = [len(r["losses"]) for r in results]
    assert steps[0] == steps[1] and 3 <= steps[0] < 100, steps
    assert all(r["interrupted"] for r in results)
    from ndparallel import checkpoint

    assert Path(checkpoint.latest(tmp_path / "ckpt")).name == f"step-{steps[0]:08d}"


def _worker_pid(agent: int, local_rank: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in children_of(agent):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except FileNotFoundError:
                continue
            if f"LOCAL_RANK={local_rank}".encode() in env:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under pid {agent}")


def _wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _launch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """Start a long 2-rank training job; its stdout/stderr go to tmp_path/out.txt and err.txt."""
    config = tmp_path / "job.yaml"
    steps = _config({"dp_shard_size": 2}, str(tmp_path / "ckpt"), every=2)
    steps["train"]["steps"] = 100_000  # far more than the test waits for
    steps["train"]["log_every"] = 2  # a progress line soon after a restart (the job trains while a test waits)
    steps["train"]["metrics_file"] = str(tmp_path / "metrics.jsonl")
    # A killed rank is judged lost after 3 s of silence, not 6 (the default 600 s); a hang would end the job after
    # 20 s, as in test_job_faults.py's two-node runs (`--timeout 20`), which start as many ranks.
    steps["train"]["timeout_s"] = 20
    config.write_text(json.dumps(steps))  # JSON is YAML
    return start_ndparallel(
        "launch",
        "--cpu-ranks",
        "2",
        *extra,
        "--",
        "train",
        "--config",
        str(config),
        stdout=open(tmp_path / "out.txt", "w"),  # noqa: SIM115  (closed with the process)
        stderr=open(tmp_path / "err.txt", "w"),  # noqa: SIM115
    )


@pytest.mark.jobs
def test_sigkilled_rank_ends_the_job_and_resume_continues(tmp_path):
    job = _launch(tmp_path)
    try:
        _wait_for(tmp_path / "ckpt" / "step-00000002")
        os.kill(_worker_pid(job.pid, 1), signal.SIGKILL)
        job.wait(timeout=90)
    finally:
        job.kill()
    assert job.returncode != 0
    assert "rank 1 failed first (exit code -9)" in (tmp_path / "err.txt").read_text()
    from ndparallel import checkpoint

    last = checkpoint.latest(tmp_path / "ckpt")
    assert last is not None
    saved_step = int(Path(last).name.split("-")[1])
    config = _config({"dp_shard_size": 2}, str(tmp_path / "ckpt"), resume=True, every=2)
    config["train"]["steps"] = saved_step + 2
    resumed = run_distributed(_train, 2, config)[0]
    assert resumed["start_step"] == saved_step
    assert len(resumed["losses"]) == 2


@pytest.mark.jobs
def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    job = _launch(tmp_path, "--max-restarts", "1")
    out = tmp_path / "out.txt"
    try:
        _wait_for(tmp_path / "ckpt" / "step-00000002")
        os.kill(_worker_pid(job.pid, 1), signal.SIGKILL)
        # torchrun restarts both ranks; the new attempt finds the checkpoint and says so.
        deadline = time.monotonic() + 180
        while "resumed from" not in out.read_text():
            assert job.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.3)
        _wait_for_line_after(out, "resumed from", "step ")
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=90)
    finally:
        job.kill()
    text = out.read_text()
    assert re.search(r"resumed from .*step-\d+ at step \d+", text), text[-2000:]


def _wait_for_line_after(path: Path, marker: str, prefix: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        after = path.read_text().split(marker, 1)[-1]
        if any(line.startswith(prefix) for line in after.splitlines()):
            return
        assert time.monotonic() < deadline, f"no {prefix!r} line after {marker!r}"
        time.sleep(0.3)


@pytest.mark.jobs
def test_demo_config_trains_on_four_cpu_ranks():
    # 12 steps (all in warmup) already take the loss from 5.60 to 4.50 (measured), twice the margin asserted;
    # 30 steps only made the test slower.
    result = run_ndparallel(
        "train",
        "--config",
        "configs/demo.yaml",
        "--cpu-ranks",
        "4",
        "train.steps=12",
        "train.log_every=4",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(4 ranks, cpu)" in result.stdout
    done = [line for line in result.stdout.splitlines() if line.startswith("done: 12 steps")]
    assert done, result.stdout
    first, last = (float(x) for x in done[0].split("loss ")[1].split(" |")[0].split(" -> "))
    assert last < first - 0.5, "the loss must visibly fall"
