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
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from ndparallel import checkpoint
from ndparallel.checkpoint.lock import CheckpointDirLock, check_not_locked
from ndparallel.distributed.agree import agree
from ndparallel.errors import CheckpointError
from ndparallel.train.job_config import CheckpointConfig

__all__ = ["check_before_start", "hold_checkpoint_dir"]


def _check_writable_folder(directory: str) -> None:
    """``directory`` is (or can be made) a folder in which this process can create a file."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"checkpoint.dir={directory!r} is a file, not a folder: pick a folder (created if missing)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ndparallel-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.dir={directory!r} is not writable ({e.strerror or e}): pick a folder you can write to"
        ) from e


def check_before_start(c: CheckpointConfig, *, lock: bool = True) -> None:
    """The checks that need no process group; raises :class:`CheckpointError` (one line) on the first failure."""
    if c.dir:
        _check_writable_folder(c.dir)
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
