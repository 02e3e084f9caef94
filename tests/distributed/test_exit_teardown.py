"""The exit teardown a torchrun rank registers (``ndparallel.distributed.process._destroy_at_exit``): a rank ending
normally waits for its peers, then destroys its group; one ending on a reported error does not wait. Real gloo
ranks; the hook is called directly, as ``atexit`` would. The exit abort of a watchdog thread caught in a store call
at finalization is forced in a real process (tests/stress/watchdog_exit.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ndparallel.testing import run_distributed

REPO = Path(__file__).resolve().parents[2]


def _both_end_normally() -> dict:
    import torch
    import torch.distributed as dist

    from ndparallel.distributed import process

    value = torch.ones(1)
    dist.all_reduce(value)
    start = time.monotonic()
    if dist.get_rank() == 1:
        time.sleep(1.0)  # the peer reaches its exit late: rank 0 must wait for it at the barrier
    met = process._destroy_at_exit()
    waited = time.monotonic() - start
    return {"destroyed": not dist.is_initialized(), "met": met, "waited_s": waited, "sum": value.item()}


def _rank_0_reported_an_error() -> dict:
    import torch.distributed as dist

    from ndparallel.distributed import process

    start, met = time.monotonic(), "not called"
    if dist.get_rank() == 0:
        process.exit_without_barrier()
        met = process._destroy_at_exit()  # its peer never comes to a barrier: it must not wait EXIT_BARRIER_S
    else:
        dist.destroy_process_group()
    return {"destroyed": not dist.is_initialized(), "took_s": time.monotonic() - start, "met": met}


def test_exit_teardown_waits_for_peers_and_destroys_the_group():
    ranks = run_distributed(_both_end_normally, 2, timeout=120)
    assert all(r["destroyed"] and r["sum"] == 2.0 for r in ranks), ranks
    # rank 0 waited for rank 1 at the barrier, which both passed (not its EXIT_BARRIER_S timeout: wall time is not
    # a proxy for that on a loaded machine, where this took 12 s)
    assert all(r["met"] is True for r in ranks) and ranks[0]["waited_s"] >= 0.9, ranks


def test_a_rank_ending_on_a_reported_error_does_not_wait():
    from ndparallel.distributed.process import EXIT_BARRIER_S

    ranks = run_distributed(_rank_0_reported_an_error, 2, timeout=120)
    assert all(r["destroyed"] for r in ranks), ranks
    # no barrier at all (None), rather than a wall-clock bound: on a loaded machine the teardown alone took 11 s
    assert ranks[0]["met"] is None and ranks[0]["took_s"] < 3 * EXIT_BARRIER_S, ranks


@pytest.mark.jobs  # a Python process that really exits (ranks of run_distributed skip finalization)
def test_the_watchdog_is_stopped_before_finalization_even_after_torchs_own_destroy(tmp_path):
    """tests/stress/watchdog_exit.py: the heartbeat thread blocked in a store call as the interpreter exits. The
    exit teardown stops it (and waits it out) also when the script destroyed the group with torch's call; before,
    it returned early and the process aborted: "terminate called without an active exception", -6 (2 of 2 runs)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "stress" / "watchdog_exit.py"), str(tmp_path / "store")],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "DONE"
