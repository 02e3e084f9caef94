"""One job per checkpoint folder: a lock file naming its holder (host, pid), taken over when stale.

::

    with CheckpointDirLock("ckpt"):        # raises CheckpointError if another live job holds it
        ...                                # save / prune under ckpt

The lock is the file ``<dir>/ndparallel.lock``, created atomically (``O_CREAT | O_EXCL``, which
shared filesystems honour too) and holding JSON: host, pid, the process's start time (to tell a
reused pid from the holder) and when it was taken. A second job finds the file and is refused
with a message naming the holder. A lock whose holder is on this host and no longer running is
stale: it is taken over with a warning. A holder on another host cannot be checked from here; the
message says to delete the file if that job is gone. ``ndparallel train`` takes it on rank 0
before it resumes or saves, and releases it when the job ends (a killed job leaves a stale lock).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from ndparallel.errors import CheckpointError

__all__ = ["LOCK_FILE", "CheckpointDirLock", "check_not_locked"]

LOCK_FILE = "ndparallel.lock"
_ATTEMPTS = 5


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _this_process() -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _start_time(pid), "since": now}


def _running(holder: dict[str, Any]) -> bool | None:
    """True/False if ``holder`` (a parsed lock) is on this host and running / gone; None for another host."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    started = holder.get("pid_start")
    return started is None or _start_time(pid) in (None, started)  # a different start time: a reused pid


def _read(lock: Path) -> tuple[dict[str, Any] | None, int | None]:
    """The lock's content (None if unreadable or not ours) and its inode (None if it is gone)."""
    try:
        with open(lock) as f:
            inode = os.fstat(f.fileno()).st_ino
            text = f.read()
    except FileNotFoundError:
        return None, None
    except OSError:
        return None, -1
    try:
        holder = json.loads(text)
    except ValueError:
        return None, inode
    return (holder if isinstance(holder, dict) else None), inode


def _describe(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')!r} (since {holder.get('since')})"


def _refusal(directory: Path, holder: dict[str, Any] | None, running: bool | None) -> CheckpointError:
    lock = directory / LOCK_FILE
    if holder is None:
        return CheckpointError(
            f"checkpoint folder {str(directory)!r} is locked by {str(lock)!r}, which cannot be read: if no "
            "job uses this folder, delete that file"
        )
    where = "" if running else "; it may be running on that host: if it is gone, delete that file"
    return CheckpointError(
        f"checkpoint folder {str(directory)!r} is in use by another job: {_describe(holder)} holds {str(lock)!r}"
        f"{where}. Wait for it to end or pick another checkpoint.dir"
    )


def check_not_locked(directory: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` if a live (or unverifiable) job holds ``directory``'s lock; reads only."""
    directory = Path(directory)
    holder, inode = _read(directory / LOCK_FILE)
    if inode is None:
        return
    running = _running(holder) if holder is not None else None
    if holder is None or running is not False:
        raise _refusal(directory, holder, running)


class CheckpointDirLock:
    """The lock of one checkpoint folder; :meth:`acquire` / :meth:`release`, or use it as a context manager."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._inode: int | None = None

    def acquire(self) -> None:
        """Take the lock (creating the folder); raises :class:`CheckpointError` naming a live holder."""
        self.directory.mkdir(parents=True, exist_ok=True)
        me = _this_process()
        for attempt in range(_ATTEMPTS):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                    f.flush()
                    os.fsync(f.fileno())
                    self._inode = os.fstat(f.fileno()).st_ino
                return
            holder, inode = _read(self.path)
            if inode is None:
                continue  # released meanwhile: try again
            if holder is None and attempt < _ATTEMPTS - 1:
                time.sleep(0.1)  # being written by its creator right now
                continue
            running = _running(holder) if holder is not None else None
            if holder is None or running is not False:
                raise _refusal(self.directory, holder, running)
            if self._take_over(inode):
                warnings.warn(
                    f"took over the stale lock of {str(self.directory)!r}: {_describe(holder)} is no longer running",
                    stacklevel=2,
                )
        raise CheckpointError(f"could not take the lock {str(self.path)!r}: other jobs keep taking it")

    def _take_over(self, stale_inode: int) -> bool:
        """Remove the stale lock file with inode ``stale_inode``; False if someone else got there first."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, aside)  # atomic: of several takers, each moves a different file (or none)
        except FileNotFoundError:
            return False
        if os.stat(aside).st_ino != stale_inode:  # a fresh lock of a faster taker: put it back
            os.rename(aside, self.path)
            return False
        aside.unlink()
        return True

    def release(self) -> None:
        """Remove the lock file if it is still ours (a no-op otherwise)."""
        if self._inode is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()
        self._inode = None

    def __enter__(self) -> CheckpointDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
