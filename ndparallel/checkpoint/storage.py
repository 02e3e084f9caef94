"""The checkpoint folder: atomic commit (fsync, marker last, rename), validate, latest, prune.

A save writes into ``<path>.tmp-<id>`` (stamped as ours: see :mod:`~ndparallel.checkpoint.leftovers`).
Rank 0 commits it: the state JSON, then the marker (last, fsynced), then one rename into place (an
atomic exchange where an older checkpoint is replaced, on Linux), so a save that dies half-way
leaves the previous checkpoint intact. "Latest" means most recently committed (the marker's
``created_unix``, not the highest step), so after a rollback the new branch wins; the same order
decides what :func:`prune` deletes. Only complete checkpoints and our own stamped leftovers are
ever deleted.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import json
import os
import shlex
import shutil
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ndparallel.checkpoint import leftovers
from ndparallel.checkpoint.checksums import check_files, sha256_file, verify_share
from ndparallel.checkpoint.dcp_metadata import read_metadata
from ndparallel.checkpoint.format import MARKER, STATE_FILE, build_marker, commit_key, parse_marker
from ndparallel.distributed.agree import agree, broadcast_text, rank
from ndparallel.errors import CheckpointError

__all__ = [
    "check_keep_last",
    "commit",
    "create_tmp",
    "discard",
    "latest",
    "prune",
    "prune_except",
    "resolve_latest",
    "tmp_path",
    "validate",
    "validate_and_read",
]

# Test hook: rank 0 SIGKILLs itself at this commit stage ("before_marker" or "before_rename").
_CRASH_ENV = "NDPARALLEL_CHECKPOINT_TEST_CRASH"


# ----------------------------------------------------------------------------- files: fsync, rename


def _fsync_dir(path: str | Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _exchange(a: str, b: str) -> bool:
    # Linux renameat2(RENAME_EXCHANGE) swaps two directories atomically; os.rename cannot replace a
    # non-empty directory. Returns False where unsupported (other OSes, some network filesystems).
    if sys.platform != "linux":
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _replace_dir(tmp: Path, path: Path, token: str) -> None:
    """Move the complete ``tmp`` to ``path``, replacing an existing checkpoint there."""
    if not path.exists():
        os.rename(tmp, path)
    elif _exchange(str(tmp), str(path)):
        shutil.rmtree(tmp)  # now holds the old checkpoint
    else:  # two renames: for a moment only <path>.old-<id> (complete) exists
        old = path.with_name(leftovers.leftover_name(path.name, "old", token))
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    _fsync_dir(path.parent)


def _crash_hook(stage: str) -> None:
    if os.environ.get(_CRASH_ENV) == stage:
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- the temporary directory and the commit


def tmp_path(path: Path, token: str) -> Path:
    """The temporary directory of save ``token`` of checkpoint ``path``: ``<path>.tmp-<token>``."""
    return path.with_name(leftovers.leftover_name(path.name, "tmp", token))


def create_tmp(path: Path, tmp: Path) -> None:
    """Rank 0: remove what earlier crashed saves of ``path`` left (ours only), then create ``tmp``, stamped. A
    complete checkpoint stranded there while ``path`` holds none (:func:`_stranded`) is kept: it is the only copy
    of its checkpoint, and this save may still fail; once ``path`` is complete again it is an ordinary leftover."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} exists and is not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = {left for _, left, target in _stranded(path.parent) if target == path}
    for p in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):
        if leftovers.is_leftover(p, path.name) and p not in keep:
            shutil.rmtree(p, ignore_errors=True)
    tmp.mkdir()
    leftovers.write_stamp(tmp, path.name)


def discard(tmp: Path) -> None:
    """Rank 0 removes the temporary directory of a save that failed on some rank (nothing was committed)."""
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: Path, path: Path, token: str, skeleton: Any, info: dict[str, Any], digests: dict[str, str]) -> None:
    """Rank 0, after every rank's data is on disk and hashed (``digests``): state JSON, marker (last), rename."""
    _write_json(tmp / STATE_FILE, skeleton)
    _crash_hook("before_marker")
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    now = datetime.datetime.now(datetime.timezone.utc)
    # The commit order decides latest() and prune(): the checkpoint committed now must come last
    # even if this host's clock is behind the one that wrote the newest sibling.
    created_unix = max(now.timestamp(), _newest_commit_time(path.parent) + 1e-3)
    # The ranks hashed the files they listed; anything else (the state JSON) is hashed here.
    sha256 = {name: digests.get(name) or sha256_file(tmp / name) for name in files}
    marker = build_marker(info, now.isoformat(timespec="seconds"), created_unix, files, sha256)
    _write_json(tmp / MARKER, marker)
    _fsync_dir(tmp)
    _crash_hook("before_rename")
    _replace_dir(tmp, path, token)


# ----------------------------------------------------------------------------- validate / latest / prune


def validate(path: str | os.PathLike, *, checksums: bool = False) -> dict[str, Any]:
    """Check that ``path`` is a complete, intact checkpoint; return its marker. Raises :class:`CheckpointError`.

    Checks: the marker exists and parses, each of its fields has the right type and range (see
    :mod:`~ndparallel.checkpoint.format`), its format version is known, every file it lists exists
    with the recorded size, DCP's ``.metadata`` and the state JSON match their recorded SHA-256
    (which must be there), and ``.metadata`` passes the allow-list
    (:func:`~ndparallel.checkpoint.dcp_metadata.read_metadata`: nothing in it is run). With
    ``checksums``, every file's SHA-256 too. Reads only; no process group needed.
    """
    return validate_and_read(path, checksums=checksums)[0]


def validate_and_read(path: str | os.PathLike, *, checksums: bool = False) -> tuple[dict[str, Any], Metadata]:
    """:func:`validate`, returning the marker and DCP's metadata (read once, through the allow-list)."""
    path = Path(path)
    if not path.is_dir():
        stranded = [old for _, old, target in _stranded(path.parent) if target == path]
        hint = f"; {_restore_hint(stranded[-1], path)}" if stranded else ""
        raise CheckpointError(f"no checkpoint directory at {str(path)!r}{hint}")
    marker_path = path / MARKER
    if not marker_path.is_file():
        foreign = _accelerate_layout(path)
        if foreign:
            raise CheckpointError(
                f"{str(path)!r} was written by 🤗 Accelerate's save_state ({', '.join(foreign)}), not by ndparallel: "
                "its folders (and pickled random_states_*.pkl, never loaded here) are not read; load the weights with "
                "Accelerate or from a save_pretrained folder (ndparallel.hf.load_pretrained), then save with "
                "ndparallel's save_state"
            )
        hint = "; it holds checkpoints: pass resolve_latest(root) instead" if _candidates(path) else ""
        raise CheckpointError(
            f"{str(path)!r} has no {MARKER}: the save did not complete (crashed or still running) or this "
            f"is not an ndparallel checkpoint{hint}"
        )
    marker = parse_marker(marker_path)
    check_files(path, marker)
    metadata = read_metadata(path)  # refused (forged, its hash recomputed): the checkpoint is corrupt too
    if checksums:
        verify_share(path, marker, 0, 1)
    return marker, metadata


def _accelerate_layout(path: Path) -> list[str]:
    """The entries of ``path`` that 🤗 Accelerate's ``save_state`` writes (``pytorch_model_fsdp_0/``,
    ``optimizer_0/``, ``model.safetensors`` + ``optimizer.bin``, ``random_states_0.pkl``), when some are there."""
    names = sorted(p.name for p in path.iterdir())
    theirs = [n for n in names if n.startswith(("pytorch_model_fsdp_", "optimizer_", "random_states_"))]
    return theirs + [n for n in names if n in ("optimizer.bin", "scheduler.bin")] if theirs else []


def _candidates(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and not leftovers.reserved(p.name) and (p / MARKER).is_file()]


def _newest_commit_time(root: Path) -> float:
    """The newest ``created_unix`` among the well-formed markers under ``root`` (files not checked)."""
    newest = 0.0
    for p in _candidates(root):
        try:
            newest = max(newest, commit_key(parse_marker(p / MARKER), p)[0])
        except CheckpointError:
            continue
    return newest


def _complete(root: str | os.PathLike) -> list[tuple[tuple[float, int, str], Path]]:
    """Complete checkpoints under ``root``, in commit order (oldest first); corrupt ones skipped with a warning."""
    found = []
    for p in _candidates(Path(root)):
        try:
            marker = validate(p)
        except CheckpointError as e:
            warnings.warn(f"skipping corrupt checkpoint: {e}", stacklevel=3)
            continue
        found.append((commit_key(marker, p), p))
    return sorted(found)


def _is_complete(path: Path) -> bool:
    if not path.is_dir():
        return False
    try:
        validate(path)
    except CheckpointError:
        return False
    return True


def _stranded(root: Path) -> list[tuple[tuple[float, int, str], Path, Path]]:
    """Complete checkpoints a save that died left beside ``<name>`` while ``<name>`` holds no complete one: the
    previous checkpoint in a stamped ``<name>.old-<id>`` (it died between the two renames of a replacement,
    where there is no atomic exchange) and the new one in its ``<name>.tmp-<id>`` (it died after writing the
    marker, before or between the renames). Each is the only copy of its checkpoint. As (commit key, the
    folder, ``<name>``), in commit order (the new one last). Once ``<name>`` is complete again (the save
    finished, or a folder was renamed back), they are ordinary leftovers."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        name = leftovers.leftover_target(p)
        if name is None or _is_complete(root / name):
            continue
        try:
            marker = validate(p)
        except CheckpointError:
            continue
        found.append((commit_key(marker, p), p, root / name))
    return sorted(found)


def _restore_hint(left: Path, target: Path) -> str:
    which = "new" if left.name.startswith(leftovers.leftover_name(target.name, "tmp", "")) else "previous"
    return (
        f"a save that died while committing {str(target)!r} left the complete {which} checkpoint in "
        f"{str(left)!r}: restore it with `mv {shlex.quote(str(left))} {shlex.quote(str(target))}`"
    )


def latest(root: str | os.PathLike) -> str | None:
    """The most recently committed complete checkpoint directly under ``root``, or None.

    Commit order, not step order: after a rollback (resume from ``step-500``, save ``step-600``)
    the new branch's ``step-600`` is the latest even though an abandoned ``step-1000`` exists.
    Ties are broken by the higher step. Partial directories (no marker, e.g. ``step-200.tmp-<id>``
    left by a crash) are ignored; corrupt ones (also a ``.metadata`` the allow-list refuses) are
    skipped with a warning. A complete checkpoint stranded in ``<name>.old-<id>`` (a save died between
    the two renames of a replacement) that is newer than every committed one raises a
    :class:`CheckpointError` saying how to rename it back (an older one: a warning). Reads only, in this
    process: under a process group use :func:`resolve_latest` so every rank gets the same answer.
    """
    found = _complete(root)
    stranded = _stranded(Path(root))
    if stranded and (not found or stranded[-1][0] > found[-1][0]):
        _, old, target = stranded[-1]
        instead = f", or delete it to use {str(found[-1][1])!r}" if found else ""
        raise CheckpointError(
            f"the newest checkpoint under {str(root)!r} is not in place: {_restore_hint(old, target)}{instead}"
        )
    for _, old, target in stranded:
        warnings.warn(f"kept: {_restore_hint(old, target)}, or delete it", stacklevel=2)
    return str(found[-1][1]) if found else None


def resolve_latest(root: str | os.PathLike) -> str | None:
    """:func:`latest` as rank 0 sees it, on every rank; every rank calls it (collective).

    Rank 0 alone scans ``root`` and broadcasts the path (or None), so ranks never pick different
    checkpoints (a node that does not see a file yet, a save committed between two ranks' scans).
    :func:`~ndparallel.checkpoint.load` then validates the chosen checkpoint on every rank.
    Without a process group (or with one rank) it is exactly ``latest(root)``.
    """
    found, error = "", None
    if rank() == 0:
        try:
            found = latest(root) or ""
        except Exception as e:  # raised on every rank by agree
            error = e
    agree(error, f"could not look for checkpoints under {str(root)!r}")
    return broadcast_text(found) or None


def check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} must be a positive integer (or None to keep all)")


def prune(root: str | os.PathLike, keep: int) -> list[str]:
    """Delete all but the ``keep`` most recently committed checkpoints under ``root`` (one process, e.g. rank 0).

    The order is :func:`latest`'s: commit time, so after a rollback the abandoned branch's
    checkpoints age out like any older commit. Also removes leftovers of crashed saves
    (``*.tmp-<id>`` / ``*.old-<id>`` directories that hold our stamp) older than the newest
    checkpoint; nothing else. A complete checkpoint in ``<name>.old-<id>`` while ``<name>`` holds
    none (a save died between the two renames of a replacement) is the only copy and is kept
    (:func:`latest` says how to rename it back). Returns the deleted paths.
    """
    return prune_except(root, keep, protect=None)


def prune_except(root: str | os.PathLike, keep: int, protect: Path | None) -> list[str]:
    """:func:`prune`, never deleting ``protect`` (the checkpoint ``save(keep_last=...)`` just committed)."""
    check_keep_last(keep)
    root = Path(root)
    found = _complete(root)
    deleted = [p for _, p in found[:-keep] if p != protect]
    stranded = {old for _, old, _ in _stranded(root)}  # the only copy of a checkpoint: never deleted
    if found:
        newest = found[-1][0][0]
        deleted += [
            p
            for p in root.iterdir()
            if leftovers.is_leftover(p) and p not in stranded and p.stat().st_mtime < newest - 1.0
        ]
    for p in deleted:
        shutil.rmtree(p, ignore_errors=True)
    if deleted:
        _fsync_dir(root)
    return [str(p) for p in deleted]
