"""Isolation between tests: a test that starts a one-process group in the pytest process (``load_pretrained``
or ``init_distributed`` without ranks) leaves it to no later test."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
