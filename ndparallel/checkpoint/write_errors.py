"""A checkpoint write that failed because the disk is full, as one line.

DCP reports a failed write as a ``CheckpointException`` holding every rank's traceback (193 lines for two
ranks), and a full disk often does not even say so: torch's writer checks its position after a short write
(``RuntimeError: ... unexpected pos 704 vs 598``). :func:`disk_full` recognises the case (an ``ENOSPC`` /
``EDQUOT`` error, or a short write with less space left than the save needs) and names the folder. The
save itself has already refused to commit: the previous checkpoints are untouched (docs/checkpointing.md).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from ndparallel.errors import CheckpointError

__all__ = ["disk_full"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_SHORT_WRITE = ("unexpected pos", "No space left on device", "Disk quota exceeded", "file write failed")


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and, inside DCP's ``CheckpointException``, every rank's exception, each with its chain."""
    found: list[BaseException] = []
    pending = [error]
    if isinstance(error, CheckpointException):
        for failure in error.failures.values():
            pending.append(failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure))
    while pending:
        cause = pending.pop()
        if isinstance(cause, BaseException) and cause not in found:
            found.append(cause)
            pending += [c for c in (cause.__cause__, cause.__context__) if c is not None]
    return found


def disk_full(error: BaseException, directory: Path, needed_bytes: int) -> CheckpointError | None:
    """The one-line error for a write into ``directory`` that failed for lack of space (``needed_bytes``: what
    this rank was writing), or None when ``error`` is something else."""
    causes = _causes(error)
    no_space = any(isinstance(c, OSError) and c.errno in _NO_SPACE for c in causes)
    folder = directory.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    short = any(any(s in str(c) for s in _SHORT_WRITE) for c in causes)
    if not (no_space or (short and free is not None and free < needed_bytes)):
        return None
    left = f"{free / 2**20:.1f} MiB free, " if free is not None else ""
    return CheckpointError(
        f"checkpoint {str(directory.name.split('.tmp-')[0])!r} not saved: no space left on device in {str(folder)!r} "
        f"({left}this rank's share needs {needed_bytes / 2**20:.1f} MiB); nothing was committed and the previous "
        "checkpoints are untouched: free space there, or save to another folder"
    )
