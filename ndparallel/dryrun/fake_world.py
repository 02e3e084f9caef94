"""This process as rank ``r`` of a world of ``N`` on torch's fake process group (collectives move nothing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from ndparallel.distributed.process import destroy_distributed
from ndparallel.dryrun.torch_api import fake_store
from ndparallel.errors import ConfigError

__all__ = ["MAX_WORLD", "as_rank"]

MAX_WORLD = 16_384
"""The largest world a dry run takes (the issue's target; a mesh of more ranks builds as well, slower)."""


@contextlib.contextmanager
def as_rank(rank: int, world: int) -> Iterator[None]:
    """Be ``rank`` of ``world`` on the fake backend while entered (no other process group may be running)."""
    if dist.is_initialized():
        raise ConfigError("a dry run needs this process without a process group: destroy the running one first")
    if not 1 <= world <= MAX_WORLD:
        raise ConfigError(f"--world {world}: a dry run takes 1 to {MAX_WORLD} ranks")
    dist.init_process_group(backend="fake", store=fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        destroy_distributed()
