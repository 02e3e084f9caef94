"""Which directories a save of ours left behind: exact names plus a stamp, so a user's folder is never removed.

A save writes ``<name>.tmp-<16 hex digits>`` and, while it replaces an existing checkpoint without
an atomic exchange, ``<name>.old-<16 hex digits>``. Rank 0 puts a stamp file in the temporary
directory as soon as it creates it; the stamp names ``<name>``, and stays in the checkpoint after
the commit. Cleaning up (``save``'s own leftovers, ``prune``) removes a directory only when its name
has that exact form *and* it holds our stamp for that ``<name>``: ``results.old-2024/`` or
``db.tmp-1/`` of a user are never touched, whatever their age.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = ["STAMP", "is_leftover", "leftover_name", "leftover_target", "new_token", "reserved", "write_stamp"]

STAMP = "ndparallel_save.json"
"""Written by rank 0 into every directory a save creates, before anything else."""
_FORMAT = "ndparallel-checkpoint"
_LEFTOVER = re.compile(r"(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{16}")


def new_token(time_ns: int) -> str:
    """The 16-hex-digit id of one save (rank 0 picks it from its clock and broadcasts it)."""
    return f"{time_ns & (2**62 - 1):016x}"


def leftover_name(name: str, kind: str, token: str) -> str:
    """``<name>.tmp-<token>`` or ``<name>.old-<token>``."""
    return f"{name}.{kind}-{token}"


def reserved(name: str) -> bool:
    """True for a name of the form our temporary directories take (a checkpoint may not be saved there)."""
    return _LEFTOVER.fullmatch(name) is not None


def write_stamp(directory: Path, name: str) -> None:
    """Mark ``directory`` (just created by this save) as ours, for checkpoint ``name``."""
    with open(directory / STAMP, "w") as f:
        json.dump({"format": _FORMAT, "name": name}, f)
        f.flush()
        os.fsync(f.fileno())


def is_leftover(path: Path, name: str | None = None) -> bool:
    """True if ``path`` is a temporary or replaced directory of one of our saves (of ``name``, if given)."""
    match = _LEFTOVER.fullmatch(path.name)
    if match is None or (name is not None and match["name"] != name):
        return False
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp.get("format") == _FORMAT and stamp.get("name") == match["name"]


def leftover_target(path: Path) -> str | None:
    """``<name>`` if ``path`` is our stamped ``<name>.old-<id>`` (a checkpoint a save was replacing) or
    ``<name>.tmp-<id>`` (a save's own folder, complete once its marker is written), else None."""
    match = _LEFTOVER.fullmatch(path.name)
    return match["name"] if match is not None and is_leftover(path) else None
