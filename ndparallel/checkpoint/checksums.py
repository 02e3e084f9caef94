"""Checksums: the files a marker lists, their sizes and SHA-256, hashed and verified in shares over the ranks.

:func:`check_files` is the quick check every ``validate`` runs: every file the marker lists exists
with its recorded size, and the two small files DCP and ndparallel read first (``.metadata`` and
the state JSON) match their SHA-256, which must be present.

Since format version 2 the marker holds the SHA-256 of every file. The ranks share the hashing:
after the write each hashes its part of the directory (:func:`hash_share`; in the background for
an asynchronous save), and at load each verifies its part (:func:`verify_share`), so the whole
checkpoint is read once, spread over the ranks. Version 1 markers hash only the two small files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ndparallel.checkpoint.format import ALWAYS_HASHED, MARKER, STATE_FILE
from ndparallel.errors import CheckpointError

__all__ = ["check_files", "hash_share", "sha256_file", "verify_share"]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_files(directory: Path, marker: dict[str, Any]) -> None:
    """Every file the (parsed) marker lists exists with its size; the always-hashed files match their SHA-256."""
    for name, size in marker["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {str(directory)!r} is corrupt: file {name!r} listed in {MARKER} is missing"
            )
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint {str(directory)!r} is corrupt: {name!r} has {actual} bytes, {MARKER} recorded {size} "
                "(truncated or modified)"
            )
    for name in ALWAYS_HASHED:
        digest = marker["sha256"].get(name)
        if digest is None:
            raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: {MARKER} has no SHA-256 for {name!r}")
        if sha256_file(directory / name) != digest:
            raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: {name!r} does not match its SHA-256")


def _hashed_files(directory: Path) -> list[str]:
    """Files of a written (not yet committed) checkpoint directory whose hashes the ranks share."""
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.is_file() and p.name not in (MARKER, STATE_FILE) and not p.name.endswith(".part")
    )


def hash_share(directory: Path, rank: int, world_size: int) -> dict[str, str]:
    """SHA-256 of this rank's part (every ``world_size``-th, by name) of the files in ``directory``."""
    return {name: sha256_file(directory / name) for name in _hashed_files(directory)[rank::world_size]}


def verify_share(directory: Path, marker: dict[str, Any], rank: int, world_size: int) -> None:
    """Check this rank's part of the files against the marker's SHA-256 (the always-hashed ones excepted:
    :func:`check_files` checked them on every rank). Raises :class:`CheckpointError` naming the file."""
    names = sorted(name for name in marker["sha256"] if name not in ALWAYS_HASHED)
    for name in names[rank::world_size]:
        if sha256_file(directory / name) != marker["sha256"][name]:
            raise CheckpointError(
                f"checkpoint {str(directory)!r} is corrupt: {name!r} does not match its SHA-256 (same size, "
                "other bytes); use another checkpoint, or load(..., verify=False) to read it anyway"
            )
