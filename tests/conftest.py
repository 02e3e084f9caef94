"""Isolation between tests: a test that starts a one-process group in the pytest process (``load_pretrained``
or ``init_distributed`` without ranks) leaves it to no later test. Under pytest-xdist, the spawned parity groups
that several test files share are computed once per run (``tests.parity.SHARED_CACHE_DIR``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _share_spawned_groups_between_workers(request, tmp_path_factory):
    """xdist's workers of one run share their base temp folder's parent: the groups cached there."""
    if hasattr(request.config, "workerinput"):  # an xdist worker
        from tests import parity

        parity.SHARED_CACHE_DIR = tmp_path_factory.getbasetemp().parent / "spawned-groups"
    yield
