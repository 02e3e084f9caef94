"""Jobs that always end and name the right rank: real launchers, real torchrun, real signals.

Each test starts ``ndparallel`` in a child process as a user's shell would, hurts it (SIGKILL of
the launcher, a rank or a whole "node", SIGTERM, a hang), and checks what is left: exit status,
the one-line report, and that no process survives.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ndparallel.launch.torchrun import children_of
from tests.command import start_ndparallel

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses prctl (Linux)"),
    pytest.mark.jobs,  # real launchers, torchrun, CLI processes or signals: not in make test-fast
]


# ----------------------------------------------------------------------------- process helpers
def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _env_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _workers(launcher: subprocess.Popen, count: int, timeout: float = 90) -> dict[int, int]:
    """Global rank -> pid of the ``count`` workers torchrun started under ``launcher``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}) before its workers started"
        ranks = {}
        for pid in children_of(launcher.pid):
            env = _env_of(pid)
            if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
                ranks[int(env["RANK"])] = pid
        if len(ranks) == count:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"{count} workers never appeared under pid {launcher.pid}")


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; returns the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _start(tmp_path: Path, *args: str, name: str = "job") -> subprocess.Popen:
    """``ndparallel ARGS`` with stdout/stderr in tmp_path/NAME.out and NAME.err."""
    return start_ndparallel(
        *args,
        stdout=open(tmp_path / f"{name}.out", "w"),  # noqa: SIM115  (closed with the process)
        stderr=open(tmp_path / f"{name}.err", "w"),  # noqa: SIM115
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A script that joins the group, proves it with one all_reduce, then keeps doing collectives.
_COLLECTIVE_LOOP = """
import os, sys, time, torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    open(os.path.join(sys.argv[1], f"ready-{dist.get_rank()}"), "w").close()
    while True:
        dist.all_reduce(t)
        time.sleep(0.01)

main()
"""


def _train_config(tmp_path: Path, steps: int = 100_000, **extra: dict) -> Path:
    config = {
        "parallelism": {"dp_shard_size": 2},
        "model": {"preset": "tiny", "max_seq_len": 64},
        "data": {"seq_len": 64, "max_bytes": 300_000},
        "train": {"steps": steps, "global_batch": 8, "lr": 0.01, "warmup_steps": 2, "log_every": 1},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 2},
    }
    for section, values in extra.items():
        config[section].update(values)
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


# ----------------------------------------------------------------------------- item 6: orphans
def test_sigkilled_launcher_takes_its_script_ranks_down(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(_COLLECTIVE_LOOP)
    job = _start(tmp_path, "launch", "--cpu-ranks", "2", "--", str(script), str(tmp_path))
    workers: dict[int, int] = {}
    try:
        workers = _workers(job, 2)
        for rank in range(2):
            _wait_for(tmp_path / f"ready-{rank}")
        job.kill()
        job.wait(timeout=10)
        left = _wait_gone(list(workers.values()), timeout=10)
    finally:
        job.kill()
        _kill_all(list(workers.values()))
    assert not left, f"ranks {left} outlived their SIGKILLed launcher"


@pytest.mark.slow
def test_sigkilled_train_launcher_takes_its_ranks_down(tmp_path):
    config = _train_config(tmp_path)
    job = _start(tmp_path, "train", "--config", str(config), "--cpu-ranks", "2")
    workers: dict[int, int] = {}
    try:
        workers = _workers(job, 2)
        _wait_for(tmp_path / "ckpt" / "step-00000002")
        job.kill()
        job.wait(timeout=10)
        killed_at = time.monotonic()
        left = _wait_gone(list(workers.values()), timeout=10)
    finally:
        job.kill()
        _kill_all(list(workers.values()))
    assert not left, f"ranks {left} outlived their SIGKILLed launcher"
    assert time.monotonic() - killed_at < 10
    # Nothing trains on behind the user's back: no checkpoint appears after the kill.
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    time.sleep(1.0)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == saved


# ----------------------------------------------------------------------------- item 7: hangs
@pytest.mark.slow
def test_a_hang_names_the_rank_behind_on_every_rank(tmp_path):
    # Rank 0 alone opens train.metrics_file before a collective; a FIFO without a reader blocks
    # that open forever, so rank 1 waits in the collective: a real hang, rank 0 is behind.
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    config = _train_config(tmp_path, steps=4)
    job = _start(
        tmp_path, "train", "--config", str(config), "--cpu-ranks", "2", "--timeout", "4", f"train.metrics_file={fifo}"
    )
    workers: dict[int, int] = {}
    hang_start = None  # rank 0 prints the model line just before it opens the FIFO: the hang begins there
    try:
        workers = _workers(job, 2)
        deadline = time.monotonic() + 300  # a guard only: torchrun and two ranks start slowly on a loaded machine
        while job.poll() is None and time.monotonic() < deadline:
            if hang_start is None and "params | mesh" in (tmp_path / "job.out").read_text():
                hang_start = time.monotonic()
            time.sleep(0.1)
        job.wait(timeout=1)
        elapsed = time.monotonic() - (hang_start or 0)
        left = _wait_gone(list(workers.values()), timeout=10)
    finally:
        job.kill()
        _kill_all(list(workers.values()))
    err = (tmp_path / "job.err").read_text()
    assert job.returncode == 124, err[-3000:]
    assert not left
    verdicts = [line for line in err.splitlines() if "hung" in line and "rank 0 did not" in line]
    # Every rank prints the verdict (torchrun prefixes nothing on plain prints: count the lines),
    # then the launcher sums it up.
    assert len(verdicts) >= 3, err[-3000:]
    assert any("opening train.metrics_file" in line and "rank 1 waits" in line for line in verdicts), verdicts
    assert any(line.startswith("ndparallel launch: the job hung") for line in verdicts), verdicts
    assert "failed first" not in err
    # From the hang to the job's end: the 4 s timeout, a few heartbeats, the wait for every rank's verdict
    # (at most 10 s) and torchrun's teardown; wall time, but only what the feature itself takes.
    assert hang_start is not None, (tmp_path / "job.out").read_text()[-3000:]
    assert elapsed < 45, f"the hang took {elapsed:.0f}s to end (timeout 4s)"


# ----------------------------------------------------------------------------- item 8: blame
@pytest.mark.slow
def test_the_first_rank_to_die_is_blamed_not_the_first_reaped(tmp_path):
    # torchrun looks at its workers every --monitor-interval seconds and stamps a killed rank with
    # the time it looked; rank 1's own error (a consequence) is stamped when it happened. A slow
    # monitor makes that order wrong; ndparallel must still blame rank 0, which died first.
    script = tmp_path / "loop.py"
    script.write_text(_COLLECTIVE_LOOP)
    job = _start(tmp_path, "launch", "--cpu-ranks", "2", "--monitor-interval", "10", "--", str(script), str(tmp_path))
    workers: dict[int, int] = {}
    try:
        workers = _workers(job, 2)
        for rank in range(2):
            _wait_for(tmp_path / f"ready-{rank}")
        while time.time() % 1 > 0.1:  # just after a second boundary: rank 1's error lands in this second
            time.sleep(0.01)
        os.kill(workers[0], signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        job.kill()
        _kill_all(list(workers.values()))
    err = (tmp_path / "job.err").read_text()
    assert "rank 0 failed first (exit code -9" in err, err[-3000:]


# ----------------------------------------------------------------------------- item 9: signals
@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_130_without_a_traceback(tmp_path):
    config = _train_config(tmp_path)
    job = _start(tmp_path, "train", "--config", str(config), "--cpu-ranks", "2")
    workers: dict[int, int] = {}
    try:
        workers = _workers(job, 2)
        _wait_for(tmp_path / "ckpt" / "step-00000002")
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=90)
    finally:
        job.kill()
        _kill_all(list(workers.values()))
    err = (tmp_path / "job.err").read_text()
    out = (tmp_path / "job.out").read_text()
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert "ndparallel launch: stopped by SIGTERM" in err
    stopped = re.search(r"stopped by signal \(received by rank \d\) after step (\d+)", out)
    assert stopped, out[-2000:]
    assert (tmp_path / "ckpt" / f"step-{int(stopped.group(1)):08d}").is_dir(), "the ranks saved where they stopped"


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_the_job_without_blaming_another(tmp_path):
    config = _train_config(tmp_path)
    job = _start(tmp_path, "train", "--config", str(config), "--cpu-ranks", "2")
    workers: dict[int, int] = {}
    try:
        workers = _workers(job, 2)
        _wait_for(tmp_path / "ckpt" / "step-00000002")
        os.kill(workers[1], signal.SIGTERM)
        job.wait(timeout=90)
    finally:
        job.kill()
        _kill_all(list(workers.values()))
    err = (tmp_path / "job.err").read_text()
    out = (tmp_path / "job.out").read_text()
    assert job.returncode == 130, err[-3000:]
    assert "failed first" not in err, err[-3000:]
    assert re.search(r"stopped by signal \(received by rank 1\) after step \d+", out), out[-2000:]
    assert "ndparallel launch: the ranks stopped on a signal" in err


# ----------------------------------------------------------------------------- multi-node
def _wait_listening(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port}"
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0], ids=["node-1-lost", "store-host-lost"])
def test_two_nodes_on_one_machine_train_together_and_a_lost_node_is_named(tmp_path, lost):
    # The demo job (dp_shard x tp 2: tp inside a node, FSDP across the two), with tiny steps.
    tiny = ["train.steps=100000", "train.global_batch=8", "data.seq_len=64", "model.max_seq_len=64"]
    tiny += ["data.max_bytes=300000", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2", "train.device=cpu"]
    port = _free_port()

    def node(rank: int) -> subprocess.Popen:
        rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(rank), "--rdzv-backend", "c10d"]
        rdzv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ndp-{port}", "--max-restarts", "0"]
        job = ["train", "--config", "configs/demo.yaml", "--timeout", "20", *tiny]
        return _start(tmp_path, "launch", *rdzv, "--", *job, name=f"node{rank}")

    nodes = [node(0)]
    _wait_listening(port)  # node 0's launcher hosts the rendezvous store
    nodes.append(node(1))
    workers: list[dict[int, int]] = []
    survivor = 1 - lost
    try:
        workers = [_workers(n, 2, timeout=120) for n in nodes]
        assert sorted([*workers[0], *workers[1]]) == [0, 1, 2, 3], workers
        _wait_for(tmp_path / "ckpt" / "step-00000002")  # the 4 ranks of 2 nodes trained together
        _kill_all([nodes[lost].pid, *workers[lost].values()])  # one node is lost, whole
        lost_at = time.monotonic()
        nodes[survivor].wait(timeout=90)
        ended_after = time.monotonic() - lost_at
        left = _wait_gone([nodes[lost].pid, *workers[0].values(), *workers[1].values()], timeout=10)
    finally:
        for n in nodes:
            n.kill()
        for w in workers:
            _kill_all(list(w.values()))
    err = (tmp_path / f"node{survivor}.err").read_text()
    assert not left, f"processes {left} were left behind"
    assert nodes[survivor].returncode == 1, err[-4000:]
    assert ended_after < 60, f"node {survivor} took {ended_after:.0f}s to end"
    ranks = "2, 3" if lost else "0, 1"
    named = [line for line in err.splitlines() if f"lost node {lost} (ranks {ranks}" in line]
    assert len(named) >= 2, err[-4000:]  # both surviving ranks say it
    summary = [line for line in err.splitlines() if line.startswith("ndparallel launch:")]
    assert len(summary) == 1 and err.strip().splitlines()[-1] == summary[0], err[-4000:]
    if lost == 1:
        assert f"lost node {lost}" in summary[0], summary


def test_the_launcher_never_lets_a_worker_start_without_it(tmp_path):
    """The worker guard refuses to run a rank whose launcher is already gone (the race prctl leaves)."""
    from ndparallel.launch.torchrun import WORKER_GUARD as guard

    env = {**os.environ, "NDP_LAUNCHER_PID": "1"}  # init is never our parent
    result = subprocess.run(
        [sys.executable, "-I", str(guard), "python", "-c", "print('ran')"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert result.returncode != 0 and "ran" not in result.stdout
    assert "launcher" in result.stderr
    env["NDP_LAUNCHER_PID"] = str(os.getpid())
    result = subprocess.run(
        [sys.executable, "-I", str(guard), "python", "-c", "import sys; print('ran', sys.argv[1:])", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert result.returncode == 0 and "ran ['x']" in result.stdout, result.stderr
