"""Isolation between tests: a test that starts a one-process group in the pytest process (``load_pretrained``
or ``init_distributed`` without ranks) leaves it to no later test. Under pytest-xdist, the spawned parity groups
that several test files share are computed once per run (``tests.parity.SHARED_CACHE_DIR``).
The ``NDP_*`` variables an in-process CLI call sets end with its test. Under pytest-xdist each worker computes with
its share of the cores (:func:`pytest_configure`). A plain ``pytest`` over the suite or a folder runs on xdist
workers (:func:`pytest_xdist_auto_num_workers`)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ndparallel.launch.exit_collections import skip_collections_at_exit


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker (and the processes it starts) gets ``cores / workers`` OpenMP threads. With torch's
    default, one per core, the two workers' references and plain runs each ran OpenMP's spin-waiting team on the
    cores the other worker's ranks needed: one 4-rank test run twice at once took 113 CPU-s instead of 53
    (docs/architecture.md, "Tests"). An ``OMP_NUM_THREADS`` the user set is kept. Every pytest process (with
    torch and transformers loaded) skips the garbage collections at exit, as the ``ndparallel`` command does."""
    skip_collections_at_exit()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "PYTEST_XDIST_WORKER" in os.environ and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


# Measured only on 2 cores, where 2 workers are best (3 contend: docs/architecture.md, "Tests"); each worker runs
# spawned groups of up to 8 ranks, so more workers than this are left to an explicit -n.
MAX_AUTO_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # xdist's hook: `-p no:xdist -o addopts=` still loads this file
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """pyproject's ``-n auto``: the suite, or a folder of it, runs on one worker per core (at most
    :data:`MAX_AUTO_WORKERS`; none on one core), one test file each at a time. Named files or tests, ``-s``,
    ``--trace`` and ``--pdb`` (xdist's own rule) run in this process, where a worker would only add its start-up
    or lose the terminal. An explicit ``-n`` (``-n 0``: no workers) or ``PYTEST_XDIST_AUTO_NUM_WORKERS`` wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist reads it
    named = [arg.split("::")[0] for arg in config.args]
    interactive = config.option.capture == "no" or config.option.trace
    if interactive or not all(os.path.isdir(path) for path in named):
        return 0
    cores = os.cpu_count() or 1  # as the harness and the launcher count them
    return min(cores, MAX_AUTO_WORKERS) if cores > 1 else 0


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _ndp_variables_restored():
    """The CLI run in-process (``main([...])``) sets ``NDP_CPU_RANKS`` / ``NDP_DEVICE`` for the ranks it would
    start, as a real launcher's process does; a later test in the same worker must not inherit them."""
    before = {name: value for name, value in os.environ.items() if name.startswith("NDP_")}
    yield
    for name in [name for name in os.environ if name.startswith("NDP_") and name not in before]:
        del os.environ[name]
    os.environ.update(before)


@pytest.fixture(scope="session", autouse=True)
def _share_spawned_groups_between_workers(request, tmp_path_factory):
    """xdist's workers of one run share their base temp folder's parent: the groups cached there."""
    if hasattr(request.config, "workerinput"):  # an xdist worker
        from tests import parity

        parity.SHARED_CACHE_DIR = tmp_path_factory.getbasetemp().parent / "spawned-groups"
    yield
