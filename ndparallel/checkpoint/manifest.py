"""The commit marker as a manifest: every field checked on its own, the files it lists, their SHA-256.

``ndparallel_meta.json`` is written last by a save; a directory is a checkpoint only if it has
one that passes :func:`parse_marker` (each field's type and range: a NaN commit time, a string
step or a list where a table belongs makes the whole marker corrupt) and :func:`check_files`
(every listed file exists with its recorded size; ``.metadata`` and the state JSON match their
SHA-256, which must be present and well formed). Nothing here trusts a number it has not checked.

Since format version 2 the marker holds the SHA-256 of every file. The ranks share the hashing:
after the write each hashes its part of the directory (:func:`hash_share`; in the background
for an asynchronous save), and at load each verifies its part (:func:`verify_share`), so the
whole checkpoint is read once, spread over the ranks. Version 1 markers hash only the two small files.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from ndparallel.errors import CheckpointError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "STATE_FILE",
    "check_files",
    "commit_key",
    "hash_share",
    "parse_marker",
    "sha256_file",
    "verify_share",
]

MARKER = "ndparallel_meta.json"
"""Written last, by rank 0: a directory without it is not a (complete) checkpoint."""
STATE_FILE = "ndparallel_state.json"
"""Everything that is not a tensor: the structure of the saved state with tensor placeholders."""
FORMAT = "ndparallel-checkpoint"
FORMAT_VERSION = 2
"""2: ``sha256`` covers every file in ``files`` (1: only ``.metadata`` and the state JSON)."""
ALWAYS_HASHED = (".metadata", STATE_FILE)
"""DCP's pickle and our JSON: their SHA-256 is checked on every validate."""


def _int(minimum: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mesh(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(m, dict)
        and isinstance(m.get("dims"), list)
        and all(isinstance(d, str) for d in m["dims"])
        and isinstance(m.get("shape"), list)
        and all(_int(1)(s) for s in m["shape"])
        for m in v
    )


def _file_name(name: Any) -> bool:
    """A path inside the checkpoint directory: relative, no ``..``, no empty parts."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    parts = PurePosixPath(name).parts
    return not PurePosixPath(name).is_absolute() and all(p not in ("", ".", "..") for p in parts)


def _files(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and all(_file_name(k) and _int(0)(size) for k, size in v.items())
        and all(name in v for name in ALWAYS_HASHED)
    )


def is_sha256(digest: Any) -> bool:
    return isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None


# field -> (rule, what it must be). Fields not listed are informational and not relied on.
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format_version": (_int(1), "a positive integer"),
    "step": (lambda v: v is None or _int(0)(v), "null or an integer >= 0"),
    "world_size": (_int(1), "an integer >= 1"),
    "mesh": (_mesh, "a list of {dims: [str], shape: [int >= 1]}"),
    "has_optimizer": (lambda v: isinstance(v, bool), "true or false"),
    "rng_ranks": (_int(0), "an integer >= 0"),
    "created": (lambda v: isinstance(v, str), "a string"),
    "created_unix": (_finite_number, "a finite number (the commit time)"),
    "files": (_files, f"a table of relative file names to sizes >= 0, listing {' and '.join(ALWAYS_HASHED)}"),
    "sha256": (
        lambda v: isinstance(v, dict) and all(isinstance(k, str) and is_sha256(d) for k, d in v.items()),
        "a table of file names to 64 lowercase hex digits",
    ),
}


def parse_marker(marker_path: Path) -> dict[str, Any]:
    """Read and check the marker at ``marker_path`` field by field; raises :class:`CheckpointError` naming the field."""
    directory = marker_path.parent
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(marker_path)!r} is unreadable or not JSON: {e}") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(f"{str(marker_path)!r} is not an ndparallel checkpoint marker")
    version = marker.get("format_version")
    if _int(1)(version) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(directory)!r} has format_version {version}; this ndparallel reads versions up to "
            f"{FORMAT_VERSION}: upgrade ndparallel"
        )
    for field, (rule, wanted) in _FIELDS.items():
        if field not in marker or not rule(marker[field]):
            got = repr(marker[field]) if field in marker else "missing"
            raise CheckpointError(
                f"checkpoint {str(directory)!r} is corrupt: {MARKER} field {field!r} is {got[:200]}, must be {wanted}"
            )
    unhashed = sorted(set(marker["files"]) - set(marker["sha256"]))
    if version >= 2 and unhashed:
        raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: {MARKER} has no SHA-256 for {unhashed[:5]}")
    unlisted = sorted(set(marker["sha256"]) - set(marker["files"]))
    if unlisted:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is corrupt: {MARKER} hashes unlisted files {unlisted[:5]}"
        )
    return marker


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


def commit_key(marker: dict[str, Any], path: Path) -> tuple[float, int, str]:
    """Commit order of a parsed marker: ``created_unix`` (rank 0's commit time), then the step, then the name."""
    step = marker["step"]
    return float(marker["created_unix"]), -1 if step is None else step, path.name
