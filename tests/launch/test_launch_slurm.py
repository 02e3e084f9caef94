"""examples/slurm/nd_parallel.sbatch runs as written with SLURM faked for 2 "nodes" on localhost.

A fake ``srun`` starts the script's launch line once per node (``SLURM_NODEID`` 0 and 1), a fake ``scontrol``
names the head node; the two ``ndparallel launch`` agents (real torchrun) meet over the c10d rendezvous and
train examples/nd_parallel.py on dp_shard 2, one rank per "node". The run only succeeds if both agents
joined one world of 2: dp_shard_size=2 does not fit a world of 1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys

import pytest

from tests.command import REPO, clean_env

pytestmark = pytest.mark.jobs  # real launchers, torchrun, CLI processes or signals: not in make test-fast

pytest.importorskip("transformers", reason="the example needs the hf extra: pip install 'ndparallel[hf]'")

SBATCH = REPO / "examples" / "slurm" / "nd_parallel.sbatch"

FAKE_SRUN = """#!/bin/bash
# srun with one task per node: the command once per node of the job, here every node is this machine.
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" > "$FAKE_SRUN_LOGS/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: one host per line.
[[ "$1 $2" == "show hostnames" ]] || exit 2
for node in $(seq "$SLURM_NNODES"); do echo localhost; done
"""


def _rendezvous_port() -> int:
    """A free port below Linux's ephemeral range (32768+): a port from bind(0) can be handed to another
    process's outgoing connection (gloo opens many) before the agent binds it, and then both agents wait
    as clients of a store nobody serves."""
    for port in random.sample(range(20000, 25000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for the rendezvous in 20000-25000")


def test_sbatch_script_trains_on_two_fake_nodes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = clean_env()
    env.update(
        PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), env.get("PATH", "")]),
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="localhost",
        NPROC_PER_NODE="1",
        RDZV_PORT=str(_rendezvous_port()),
        FAKE_SRUN_LOGS=str(tmp_path),
        OMP_NUM_THREADS="1",
    )
    out = tmp_path / "out"
    args = ["--dp-shard-size", "2", "--num-steps", "2", "--sequence-length", "16", "--mixed-precision", "no"]
    job = subprocess.Popen(
        ["bash", str(SBATCH), *args, "--save-dir", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a hung job is killed whole (no orphan agents)
    )
    try:
        output, _ = job.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
    logs = {p.name: p.read_text() for p in tmp_path.glob("node*.log")}
    assert job.returncode == 0, (output[-2000:], {k: v[-3000:] for k, v in logs.items()})
    assert sorted(logs) == ["node0.log", "node1.log"]
    # accelerator.print prints on each node's local main process, as Accelerate's does
    assert [logs[name].count("Training completed!") for name in sorted(logs)] == [1, 1]
    losses = [json.loads(line)["loss"] for line in (out / "nd_parallel_training" / "metrics.jsonl").open()]
    assert len(losses) == 2
    assert (out / "tiny-random-llama" / "model.safetensors").is_file()
