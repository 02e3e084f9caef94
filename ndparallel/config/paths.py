"""The folders a job writes into: the one check that a declared folder exists (or can be made) and is writable.

``checkpoint.dir`` of ``ndparallel train`` and ``Accelerator(project_dir=...)`` are checked with
:func:`check_writable_folder` before anything is written there, so a read-only or misspelt path is a
one-line error naming the field, not an ``OSError`` on the rank that writes first. A report file
(``ndparallel verify --json``) is checked with :func:`check_writable_file` before the run it reports.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ndparallel.errors import ConfigError

__all__ = ["check_writable_file", "check_writable_folder"]


def check_writable_folder(directory: str | os.PathLike, field: str, error_type: type[Exception] = ConfigError) -> None:
    """``directory`` (the value of ``field``) is, or can be made, a folder in which this process can create a file.

    Creates it (and its parents) if missing; raises ``error_type`` naming ``field`` and the cause otherwise.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise error_type(f"{field}={str(directory)!r} is a file, not a folder: pick a folder (created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ndparallel-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise error_type(
            f"{field}={str(directory)!r} is not writable ({e.strerror or e}): pick a folder you can write to"
        ) from e


def check_writable_file(file: str | os.PathLike, field: str, error_type: type[Exception] = ConfigError) -> None:
    """``file`` (the value of ``field``) is a file this process can write, or create in an existing folder.

    Nothing is left behind: a file created to check is removed again. Raises ``error_type`` naming ``field``.
    """
    path = Path(file)
    if path.is_dir():
        raise error_type(f"{field}={str(file)!r} is a folder: name a file, e.g. {str(path / 'report.json')!r}")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        raise error_type(
            f"{field}={str(file)!r} cannot be written ({e.strerror or e}): pick a path you can write to"
        ) from None
