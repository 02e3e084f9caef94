"""Isolation between tests: a test that starts a one-process group in the pytest process (``load_pretrained``
or ``init_distributed`` without ranks) leaves it to no later test. Under pytest-xdist, the spawned parity groups
that several test files share are computed once per run (``tests.parity.SHARED_CACHE_DIR``).
The ``NDP_*`` variables an in-process CLI call sets end with its test."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


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
