"""The training job's checkpoint folder: checked before any rank starts, locked while the job runs.

``check_before_start`` runs in the ``ndparallel train`` command before it spawns ranks (and on
rank 0 inside the job): ``checkpoint.dir`` must be a folder this process can write (it is created
if missing), not locked by another live job, and an explicit ``checkpoint.resume=PATH`` must be a
complete checkpoint. ``hold_checkpoint_dir`` then has rank 0 take the folder's lock
(:mod:`ndparallel.checkpoint.lock`) for the whole job; every rank raises the same
:class:`~ndparallel.errors.CheckpointError` if that fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from ndparallel import checkpoint
from ndparallel.checkpoint.lock import CheckpointDirLock, check_not_locked
from ndparallel.config.paths import check_writable_folder
from ndparallel.distributed.agree import agree
from ndparallel.errors import CheckpointError
from ndparallel.train.job_config import CheckpointConfig

__all__ = ["check_before_start", "hold_checkpoint_dir"]


def check_before_start(c: CheckpointConfig, *, lock: bool = True) -> None:
    """The checks that need no process group; raises :class:`CheckpointError` (one line) on the first failure."""
    if c.dir:
        check_writable_folder(c.dir, "checkpoint.dir", CheckpointError)
        if lock:
            check_not_locked(c.dir)
    if isinstance(c.resume, str):
        checkpoint.validate(c.resume)  # missing path, missing or truncated file, unknown format_version ...


@contextlib.contextmanager
def hold_checkpoint_dir(c: CheckpointConfig) -> Iterator[None]:
    """Collective: rank 0 checks ``checkpoint.dir`` and holds its lock while the body runs."""
    if not c.dir:
        yield
        return
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    held = CheckpointDirLock(c.dir)
    error: BaseException | None = None
    if rank0:
        try:
            check_before_start(c, lock=False)  # the lock itself is taken next
            held.acquire()
        except Exception as e:  # raised on every rank by agree
            error = e
    agree(error, "ndparallel train cannot use its checkpoint folder")
    try:
        yield
    finally:
        held.release()
