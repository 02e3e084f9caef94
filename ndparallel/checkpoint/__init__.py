"""Distributed checkpoints over torch.distributed.checkpoint (DCP): atomic, reshardable, no pickles of our own.

::

    ndp.checkpoint.save("ckpt/step-100", model, opt, step=100, scheduler=sched.state_dict(), keep_last=3)
    extra = ndp.checkpoint.load(ndp.checkpoint.resolve_latest("ckpt"), model, opt)   # any mesh, or one process
    sched.load_state_dict(extra["scheduler"])

A checkpoint is a directory. Model and optimizer tensors (DTensor shards included) go through DCP,
so a checkpoint saved on one mesh loads on any other. Everything that is not a tensor (optimizer
hyper-parameters, scheduler state, the data position, ``step``) is written by rank 0 as JSON, and
per-rank RNG states are saved as tensors: loading never unpickles an object of ours. The directory
is written as ``<path>.tmp-<id>``, completed by a JSON marker written last, then renamed into place,
so a save that dies half-way leaves the previous checkpoint intact. ``load`` checks the marker and
every file on every rank, and the ranks agree, before DCP touches the model: a failure seen by one
rank raises the same error on all of them instead of hanging. "Latest" means most recently
committed (not highest step), so a rollback's new branch wins. Layout and guarantees: docs/checkpointing.md.

The concepts live in modules of this package: ``manifest`` (the marker, field by field, and the
SHA-256 of every file), ``dcp_metadata`` (DCP's pickled ``.metadata`` read with an allow-list: no
code runs), ``leftovers`` (only directories with our stamp are ever removed), ``lock`` (one job per
folder), and ``ndparallel.comm.agree`` (one error on every rank).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import datetime
import glob
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from ndparallel.checkpoint import leftovers
from ndparallel.checkpoint.dcp_metadata import SafeFileSystemReader, read_metadata
from ndparallel.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    STATE_FILE,
    check_files,
    commit_key,
    hash_share,
    parse_marker,
    sha256_file,
    verify_share,
)
from ndparallel.comm.agree import agree as _agree
from ndparallel.comm.agree import broadcast_text as _broadcast_text
from ndparallel.comm.agree import distributed as _distributed
from ndparallel.comm.agree import gather_text as _gather_text
from ndparallel.comm.agree import rank as _rank
from ndparallel.comm.agree import world_size as _world_size
from ndparallel.errors import CheckpointError

__all__ = [
    "MARKER",
    "AsyncSave",
    "CheckpointError",
    "export_safetensors",
    "import_safetensors",
    "latest",
    "load",
    "prune",
    "resolve_latest",
    "save",
    "save_async",
    "validate",
]

# Test hook: rank 0 SIGKILLs itself at this commit stage ("before_marker" or "before_rename").
_CRASH_ENV = "NDPARALLEL_CHECKPOINT_TEST_CRASH"
_TENSOR, _TUPLE = "__tensor__", "__tuple__"


# ----------------------------------------------------------------------------- state <-> (JSON, tensors)


def _split(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of ``obj``; every tensor goes to ``tensors[key]`` and leaves a placeholder."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        return {_TENSOR: key, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or k in (_TENSOR, _TUPLE):
                raise CheckpointError(
                    f"checkpoint state {_display(key)!r} has key {k!r}: dict keys must be strings "
                    f"(and not {_TENSOR!r}/{_TUPLE!r}); convert the key, e.g. str({k!r})"
                )
            out[k] = _split(v, f"{key}.{k}" if key else k, tensors)
        return out
    if isinstance(obj, list):
        return [_split(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {_TUPLE: [_split(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(
        f"checkpoint state {_display(key)!r} is a {type(obj).__name__}: extra state must be tensors or JSON values "
        "(int, float, str, bool, None, and lists, tuples and str-keyed dicts of them); e.g. pass "
        "scheduler.state_dict(), not the scheduler, and int(x) for numpy integers"
    )


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """This rank's shards of the model and optimizer tensors are finite (a diverged state is never saved)."""
    checked = {
        key: local
        for key, t in tensors.items()
        if key.startswith(("model.", "optimizer.state."))
        and (local := t.to_local() if isinstance(t, DTensor) else t).is_floating_point()
    }
    if not checked:
        return
    flags = [torch.isfinite(t).all() for t in checked.values()]
    finite = torch.stack([f.to(flags[0].device) for f in flags]).tolist()  # one device sync
    for key, ok in zip(checked, finite, strict=True):
        if not ok:
            raise CheckpointError(
                f"{key!r} has NaN or inf values: a diverged state is not saved, and the checkpoints already "
                "saved are kept (pass allow_nonfinite=True to save it anyway, e.g. to inspect it)"
            )


def _display(key: str) -> str:
    return key.removeprefix("extra.") if key.startswith("extra.") else key or "<root>"


def _join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`_split`."""
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if _TUPLE in skeleton:
            return tuple(_join(v, tensors) for v in skeleton[_TUPLE])
        return {k: _join(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_join(v, tensors) for v in skeleton]
    return skeleton


def _placeholders(skeleton: Any) -> list[dict]:
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return [skeleton]
        return [p for v in skeleton.values() for p in _placeholders(v)]
    if isinstance(skeleton, list):
        return [p for v in skeleton for p in _placeholders(v)]
    return []


# ----------------------------------------------------------------------------- RNG states as tensors


def _rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    """This rank's torch CPU, CUDA (current device), python ``random`` and numpy global RNG states."""
    prefix = f"rng.rank{rank}."
    out = {prefix + "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[prefix + "torch_cuda"] = torch.cuda.get_rng_state()
    version, mt, gauss = random.getstate()
    out[prefix + "python"] = torch.tensor([version, *mt], dtype=torch.int64)
    out[prefix + "python_gauss"] = torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64)
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out[prefix + "numpy"] = torch.tensor([pos, has_gauss, *keys.tolist()], dtype=torch.int64)
    out[prefix + "numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return out


def _restore_rng(loaded: dict[str, torch.Tensor], rank: int) -> None:
    prefix = f"rng.rank{rank}."
    torch.set_rng_state(loaded[prefix + "torch_cpu"])
    if prefix + "torch_cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded[prefix + "torch_cuda"])
    py, py_gauss = loaded[prefix + "python"].tolist(), loaded[prefix + "python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), py_gauss[1] if py_gauss[0] else None))
    npy = loaded[prefix + "numpy"].tolist()
    keys = np.array(npy[2:], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, npy[0], npy[1], loaded[prefix + "numpy_gauss"].item()))


# ----------------------------------------------------------------------------- process-group helpers


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process save/load ("assuming the intent is to ... in a single
    # process"); that is exactly our intent when there is no process group.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# ----------------------------------------------------------------------------- files: fsync, rename, marker


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


def _mesh_info(model: nn.Module) -> list[dict[str, Any]]:
    seen: dict[tuple, dict[str, Any]] = {}
    for p in model.parameters():
        if isinstance(p, DTensor):
            m = p.device_mesh
            names = list(m.mesh_dim_names or [f"dim{i}" for i in range(m.ndim)])
            seen.setdefault((tuple(names), tuple(m.shape)), {"dims": names, "shape": list(m.shape)})
    return list(seen.values())


def _commit(tmp: Path, path: Path, token: str, skeleton: Any, info: dict[str, Any], digests: dict[str, str]) -> None:
    """Rank 0, after every rank's data is on disk and hashed (``digests``): state JSON, marker (last), rename."""
    _write_json(tmp / STATE_FILE, skeleton)
    _crash_hook("before_marker")
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    now = datetime.datetime.now(datetime.timezone.utc)
    # The commit order decides latest() and prune(): the checkpoint committed now must come last
    # even if this host's clock is behind the one that wrote the newest sibling.
    created_unix = max(now.timestamp(), _newest_commit_time(path.parent) + 1e-3)
    marker = dict(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        **info,
        created=now.isoformat(timespec="seconds"),
        created_unix=created_unix,
        torch_version=torch.__version__,
        files=files,
        # The ranks hashed the files they listed; anything else (the state JSON) is hashed here.
        sha256={name: digests.get(name) or sha256_file(tmp / name) for name in files},
    )
    _write_json(tmp / MARKER, marker)
    _fsync_dir(tmp)
    _crash_hook("before_rename")
    _replace_dir(tmp, path, token)


def _remove_stale_tmp(path: Path) -> None:
    """Rank 0: remove what earlier crashed saves of ``path`` left (ours only: see leftovers)."""
    for p in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):
        if leftovers.is_leftover(p, path.name):
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- save


def _prepare(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    save_rng: bool,
    keep_last: int | None,
    allow_nonfinite: bool,
    state: dict,
) -> tuple[Path, Path, str, dict[str, torch.Tensor], Any, dict[str, Any]]:
    path = Path(path).absolute()
    rank = _rank()
    # Rank 0 picks the temporary name and sends it with its path: every rank writes the same directory.
    sent = f"{leftovers.new_token(time.time_ns())} {path}" if rank == 0 else ""
    token, _, path0 = _broadcast_text(sent).partition(" ")
    error: BaseException | None = None
    try:  # everything here is rank-local: agreed below before the next collective
        if str(path) != path0:
            raise CheckpointError(
                f"rank {rank} saves to {str(path)!r}, rank 0 to {path0!r}: every rank must pass the same path"
            )
        _check_keep_last(keep_last)
        if leftovers.reserved(path.name):
            raise CheckpointError(
                f"checkpoint path {str(path)!r} must not end in .tmp-<16 hex> or .old-<16 hex>: reserved"
            )
        tree: dict[str, Any] = {}
        if optimizer is not None:
            tree["model"], tree["optimizer"] = get_state_dict(model, optimizer)
        else:
            tree["model"] = get_model_state_dict(model)
        tree["extra"] = state
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _split(tree, "", tensors)
        if not allow_nonfinite:
            _check_finite(tensors)
        if save_rng:
            tensors.update(_rng_tensors(rank))
    except Exception as e:  # raised on every rank by _agree
        error = e
    _agree(error, f"checkpoint {path0!r} not saved (nothing written)")
    step = state.get("step")
    info = dict(
        step=step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None,
        world_size=_world_size(),
        mesh=_mesh_info(model),
        has_optimizer=optimizer is not None,
        rng_ranks=_world_size() if save_rng else 0,
    )
    tmp = path.with_name(leftovers.leftover_name(path.name, "tmp", token))
    if rank == 0:
        try:
            if path.exists() and not path.is_dir():
                raise CheckpointError(f"checkpoint path {str(path)!r} exists and is not a directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_tmp(path)
            tmp.mkdir()
            leftovers.write_stamp(tmp, path.name)
        except Exception as e:  # raised on every rank by _agree
            error = e
    _agree(error, f"could not create checkpoint directory {str(tmp)!r}")
    return path, tmp, token, tensors, skeleton, info


def _discard(tmp: Path) -> None:
    """Rank 0 removes the temporary directory of a save that failed on some rank (nothing was committed)."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _hash_share(tmp: Path) -> dict[str, str]:
    """Collective: this rank's part of the written files' SHA-256; a failure on any rank fails the save everywhere."""
    digests: dict[str, str] = {}
    error: BaseException | None = None
    try:
        digests = hash_share(tmp, _rank(), _world_size())
    except Exception as e:  # raised on every rank by _agree
        error = e
    try:
        _agree(error, f"could not checksum checkpoint files in {str(tmp)!r} (nothing committed)")
    except CheckpointError:
        _discard(tmp)
        raise
    return digests


def _finish(
    path: Path, tmp: Path, token: str, skeleton: Any, info: dict, keep_last: int | None, digests: dict[str, str]
) -> str:
    # Every rank's files are written and hashed once every rank's digests arrive.
    gathered = [json.loads(text) for text in _gather_text(json.dumps(digests))]
    error: BaseException | None = None
    if _rank() == 0:
        try:
            _commit(tmp, path, token, skeleton, info, {k: v for part in gathered for k, v in part.items()})
            if keep_last is not None:
                _prune(path.parent, keep_last, protect=path)
        except Exception as e:  # raised on every rank by _agree
            error = e
    _agree(error, f"could not commit checkpoint {str(path)!r}")
    return str(path)


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    keep_last: int | None = None,
    save_rng: bool = True,
    allow_nonfinite: bool = False,
    **state: Any,
) -> str:
    """Save ``model`` (and ``optimizer``) plus extra ``state`` to directory ``path``; every rank calls it.

    ``state``: tensors and JSON values, e.g. ``step=100, scheduler=sched.state_dict(), data={"pos": 1234}``
    (rank 0's values are kept). Per-rank RNG states are saved unless ``save_rng=False``. A model
    or optimizer tensor with a NaN or inf is refused (nothing written, nothing pruned) unless
    ``allow_nonfinite=True``. The directory appears complete or not at all; an existing one is
    replaced. ``keep_last=k`` then deletes all but the ``k`` most recently committed checkpoints
    in ``path``'s parent, never the one just written (see :func:`prune`). Every rank must pass the
    same ``path``; a rank-local failure (e.g. extra state only one rank cannot store) raises on
    every rank. Returns the absolute path.
    """
    path, tmp, token, tensors, skeleton, info = _prepare(
        path, model, optimizer, save_rng, keep_last, allow_nonfinite, state
    )
    try:
        with _quiet_single_process():
            dcp.save(tensors, checkpoint_id=str(tmp), no_dist=not _distributed())
    except Exception:  # DCP reports a failed write on every rank
        _discard(tmp)
        raise
    return _finish(path, tmp, token, skeleton, info, keep_last, _hash_share(tmp))


class AsyncSave:
    """Handle of :func:`save_async`. ``wait()`` (every rank) finishes the write and commits the checkpoint."""

    def __init__(self, future: Any, finalize: Callable[[dict[str, str]], str], discard: Callable[[], None]):
        self._future = future
        self._finalize = finalize
        self._discard = discard
        self._path: str | None = None

    def done(self) -> bool:
        """True when the background write and hashing finished (the commit still needs :meth:`wait`)."""
        return self._future.done()

    def wait(self) -> str:
        """Block until the files are written, then commit (collective: every rank must call it)."""
        if self._path is None:
            error: BaseException | None = None
            digests: dict[str, str] = {}
            try:
                digests = self._future.result()
            except Exception as e:  # a write that failed on some ranks only must not strand the others
                error = e
            try:
                _agree(error, "asynchronous checkpoint write failed (nothing committed)")
            except CheckpointError:
                self._discard()
                raise
            self._path = self._finalize(digests)
        return self._path


_ASYNC_GROUPS: dict[int, Any] = {}


def _async_group() -> Any:
    # A separate gloo group for the background thread's collectives, so they never interleave
    # with the training step's collectives on the default group. Created once (a collective).
    if not _distributed():
        return None
    key = id(dist.group.WORLD)
    if key not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[key] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[key]


def save_async(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    keep_last: int | None = None,
    save_rng: bool = True,
    allow_nonfinite: bool = False,
    **state: Any,
) -> AsyncSave:
    """Like :func:`save`, but tensors are copied to CPU now and written by a background thread.

    Training may continue at once; call ``handle.wait()`` on every rank (before the next save)
    to commit. Until then ``path`` is untouched (its previous checkpoint, if any, stays valid).
    """
    path, tmp, token, tensors, skeleton, info = _prepare(
        path, model, optimizer, save_rng, keep_last, allow_nonfinite, state
    )
    group = _async_group()
    kwargs = {"process_group": group} if _distributed() else {"no_dist": True}
    with _quiet_single_process():
        future = dcp.async_save(tensors, checkpoint_id=str(tmp), **kwargs)
    # Newer torch may return an AsyncSaveResponse (staging + upload futures) instead of a Future.
    future = getattr(future, "upload_completion", future)
    hashed = _hash_when_written(future, tmp)
    return AsyncSave(
        hashed, lambda digests: _finish(path, tmp, token, skeleton, info, keep_last, digests), lambda: _discard(tmp)
    )


def _hash_when_written(written: Any, tmp: Path) -> concurrent.futures.Future:
    """A future of this rank's share of the SHA-256 (:func:`hash_share`), computed in a background
    thread once DCP's background write ``written`` is done (then every rank's files are on disk)."""
    rank, world_size = _rank(), _world_size()
    hashed: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            written.result()
            hashed.set_result(hash_share(tmp, rank, world_size))
        except BaseException as e:  # handed to wait(), which agrees on it across ranks
            hashed.set_exception(e)

    threading.Thread(target=run, name="ndparallel-checkpoint-hash", daemon=True).start()
    return hashed


def _check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} must be a positive integer (or None to keep all)")


# ----------------------------------------------------------------------------- validate / latest / prune


def validate(path: str | os.PathLike, *, checksums: bool = False) -> dict[str, Any]:
    """Check that ``path`` is a complete, intact checkpoint; return its marker. Raises :class:`CheckpointError`.

    Checks: the marker exists and parses, each of its fields has the right type and range (see
    the manifest module), its format version is known, every file it lists exists with the recorded
    size, and DCP's ``.metadata`` and the state JSON match their recorded SHA-256 (which must be
    there). Reads only; no process group needed.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {str(path)!r}")
    marker_path = path / MARKER
    if not marker_path.is_file():
        hint = "; it holds checkpoints: pass resolve_latest(root) instead" if _candidates(path) else ""
        raise CheckpointError(
            f"{str(path)!r} has no {MARKER}: the save did not complete (crashed or still running) or this "
            f"is not an ndparallel checkpoint{hint}"
        )
    marker = parse_marker(marker_path)
    check_files(path, marker)
    if checksums:
        verify_share(path, marker, 0, 1)
    return marker


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


def latest(root: str | os.PathLike) -> str | None:
    """The most recently committed complete checkpoint directly under ``root``, or None.

    Commit order, not step order: after a rollback (resume from ``step-500``, save ``step-600``)
    the new branch's ``step-600`` is the latest even though an abandoned ``step-1000`` exists.
    Ties are broken by the higher step. Partial directories (no marker, e.g. ``step-200.tmp-<id>``
    left by a crash) are ignored; corrupt ones are skipped with a warning. Reads only, in this
    process: under a process group use :func:`resolve_latest` so every rank gets the same answer.
    """
    found = _complete(root)
    return str(found[-1][1]) if found else None


def resolve_latest(root: str | os.PathLike) -> str | None:
    """:func:`latest` as rank 0 sees it, on every rank; every rank calls it (collective).

    Rank 0 alone scans ``root`` and broadcasts the path (or None), so ranks never pick different
    checkpoints (a node that does not see a file yet, a save committed between two ranks' scans).
    :func:`load` then validates the chosen checkpoint on every rank. Without a process group (or
    with one rank) it is exactly ``latest(root)``.
    """
    found, error = "", None
    if _rank() == 0:
        try:
            found = latest(root) or ""
        except Exception as e:  # raised on every rank by _agree
            error = e
    _agree(error, f"could not look for checkpoints under {str(root)!r}")
    return _broadcast_text(found) or None


def prune(root: str | os.PathLike, keep: int) -> list[str]:
    """Delete all but the ``keep`` most recently committed checkpoints under ``root`` (one process, e.g. rank 0).

    The order is :func:`latest`'s: commit time, so after a rollback the abandoned branch's
    checkpoints age out like any older commit. Also removes leftovers of crashed saves
    (``*.tmp-<id>`` / ``*.old-<id>`` directories that hold our stamp) older than the newest
    checkpoint; nothing else. Returns the deleted paths.
    """
    return _prune(root, keep, protect=None)


def _prune(root: str | os.PathLike, keep: int, protect: Path | None) -> list[str]:
    """:func:`prune`, never deleting ``protect`` (the checkpoint ``save(keep_last=...)`` just committed)."""
    _check_keep_last(keep)
    root = Path(root)
    found = _complete(root)
    deleted = [p for _, p in found[:-keep] if p != protect]
    if found:
        newest = found[-1][0][0]
        deleted += [p for p in root.iterdir() if leftovers.is_leftover(p) and p.stat().st_mtime < newest - 1.0]
    for p in deleted:
        shutil.rmtree(p, ignore_errors=True)
    if deleted:
        _fsync_dir(root)
    return [str(p) for p in deleted]


# ----------------------------------------------------------------------------- load


def _check_fits(live: dict[str, torch.Tensor], stored: dict[str, Any], path: Path, section: str, skeleton: Any) -> None:
    """Every live tensor has a stored entry of the same global shape, and vice versa for ``section``."""
    saved_keys = {p[_TENSOR] for p in _placeholders(skeleton)}
    missing = sorted(k for k in live if k not in stored or k not in saved_keys)
    unexpected = sorted(k for k in saved_keys if k not in live)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the {section}: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''} ({len(missing)}), unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''} ({len(unexpected)}); was it saved from another model?"
        )
    bad = [
        f"{k}: checkpoint {list(getattr(stored[k], 'size', ['not a tensor']))} vs {section} {list(t.shape)}"
        for k, t in live.items()
        if not isinstance(stored[k], TensorStorageMetadata) or list(stored[k].size) != list(t.shape)
    ]
    if bad:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the {section}: shapes differ: {bad[:5]}")


def _read(path: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Validate, then read the marker, the state skeleton and DCP's key -> storage metadata."""
    marker = validate(path)
    skeleton = json.loads((path / STATE_FILE).read_text())
    # DCP's .metadata is a pickle written by torch: read with an allow-list of DCP's classes, never run.
    metadata = read_metadata(path)
    return marker, skeleton, metadata.state_dict_metadata


def _empty_like_placeholder(p: dict) -> torch.Tensor:
    name = p.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):  # the JSON names a torch attribute: only a dtype may come back
        raise CheckpointError(f"{STATE_FILE} gives tensor {p.get(_TENSOR)!r} the dtype {name!r}, not a torch dtype")
    return torch.empty(p["shape"], dtype=dtype)


def _model_targets(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, restore_rng: bool
) -> tuple[dict[str, Any], Any, dict[str, Any], dict[str, torch.Tensor], list[str]]:
    """Validate ``path`` and check it against the model; the tensors to read (all but the optimizer's)."""
    marker, skeleton, stored = _read(path)
    if optimizer is not None and "optimizer" not in skeleton:
        raise CheckpointError(f"checkpoint {str(path)!r} has no optimizer state; call load without the optimizer")
    targets: dict[str, torch.Tensor] = {}
    _split(get_model_state_dict(model), "model", targets)
    _check_fits(targets, stored, path, "model", skeleton["model"])
    for p in _placeholders(skeleton.get("extra", {})):
        targets[p[_TENSOR]] = _empty_like_placeholder(p)
    rank = _rank()
    rng_keys = [k for k in stored if k.startswith(f"rng.rank{rank}.")] if restore_rng else []
    for k in rng_keys:
        meta = stored[k]
        targets[k] = torch.empty(list(meta.size), dtype=meta.properties.dtype)
    return marker, skeleton, stored, targets, rng_keys


def _optimizer_targets(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, skeleton: Any, stored: dict[str, Any]
) -> dict[str, torch.Tensor]:
    # torch's get_state_dict initialises the state of an optimizer that has none (a step with
    # lr 0), so it runs only once every rank knows the files and the model fit.
    _, optim_sd = get_state_dict(model, optimizer)
    targets: dict[str, torch.Tensor] = {}
    _split(optim_sd, "optimizer", targets)
    _check_fits(targets, stored, path, "optimizer", skeleton["optimizer"])
    # Tensors among the saved hyper-parameters (e.g. a tensor lr) are not in the live state.
    for p in _placeholders(skeleton["optimizer"]):
        targets.setdefault(p[_TENSOR], _empty_like_placeholder(p))
    return targets


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``), on any mesh; return the extra state.

    Every rank calls it with the same ``path`` (or one process without a process group; pick the
    path with :func:`resolve_latest`). Every rank validates the checkpoint and checks it against
    the model, and the ranks agree, before anything is read into it: a :class:`CheckpointError`
    (the same on every rank, naming the rank that failed) means the model and optimizer are
    untouched. With ``verify`` (the default) every file is also checked against its SHA-256
    first, each rank hashing its part; ``verify=False`` skips that read of the whole checkpoint
    (sizes and the small files are still checked). RNG states are restored for ranks that saved
    one (rank ``r`` gets rank ``r``'s) unless ``restore_rng=False``.
    """
    path = Path(path).absolute()
    path0 = _broadcast_text(str(path))
    failed = f"checkpoint {path0!r} not loaded (model and optimizer untouched)"
    error: BaseException | None = None
    try:  # rank-local checks, agreed below before DCP's collectives
        if str(path) != path0:
            raise CheckpointError(
                f"rank {_rank()} loads {str(path)!r}, rank 0 {path0!r}: every rank must load the same "
                "checkpoint (pick it with resolve_latest(root))"
            )
        marker, skeleton, stored, targets, rng_keys = _model_targets(path, model, optimizer, restore_rng)
        if verify:
            verify_share(path, marker, _rank(), _world_size())
    except Exception as e:  # raised on every rank by _agree
        error = e
    _agree(error, failed)
    if optimizer is not None:
        try:
            targets.update(_optimizer_targets(path, model, optimizer, skeleton, stored))
        except Exception as e:  # raised on every rank by _agree
            error = e
        _agree(error, failed)
    rank = _rank()

    with _quiet_single_process():
        dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=not _distributed())

    if optimizer is not None:
        saved_optim = _join(skeleton["optimizer"], targets)
        saved_model = _join(skeleton["model"], targets)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=saved_model,
            optim_state_dict=saved_optim,
            options=StateDictOptions(strict=True),
        )
    else:
        set_model_state_dict(model, _join(skeleton["model"], targets), options=StateDictOptions(strict=True))
    if rng_keys:
        _restore_rng(targets, rank)
    elif restore_rng and marker.get("rng_ranks", 0) > 0:
        warnings.warn(
            f"checkpoint {str(path)!r} has RNG states for {marker['rng_ranks']} ranks, none for rank {rank}: "
            "this rank's RNG is not restored",
            stacklevel=2,
        )
    return _join(skeleton.get("extra", {}), targets)


# ----------------------------------------------------------------------------- safetensors export / import


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:
        raise ImportError(
            "safetensors export/import needs the safetensors package: pip install safetensors "
            "(or pip install 'ndparallel[hf]')"
        ) from e
    return safetensors.torch


def _write_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    st = _safetensors()
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".part")
    st.save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, file)


def export_safetensors(source: nn.Module | str | os.PathLike, file: str | os.PathLike, *, verify: bool = True) -> str:
    """Write the full (unsharded) model weights to one safetensors ``file``.

    ``source`` is a live (possibly sharded) model, and then every rank calls it (rank 0 gathers and
    writes), or a checkpoint directory, and then it runs in one process without a process group
    (with one, rank 0 does the work and the others wait; ``verify`` checks every file's SHA-256
    first, as :func:`load` does). Keys are the model's parameter names.
    """
    error: BaseException | None = None
    try:
        _safetensors()
    except ImportError as e:  # fail early, on every rank, before any collective
        error = e
    _agree(error, "safetensors export needs the safetensors package")
    file = Path(file).absolute()
    if isinstance(source, nn.Module):
        full = get_model_state_dict(source, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if _rank() == 0:
            try:
                _write_safetensors(full, file)
            except Exception as e:  # raised on every rank by _agree
                error = e
        _agree(error, f"could not write {str(file)!r}")
        return str(file)
    path = Path(source).absolute()
    if _rank() == 0:
        try:
            _export_checkpoint(path, file, verify)
        except Exception as e:  # raised on every rank by _agree
            error = e
    _agree(error, f"could not export {str(path)!r}")
    return str(file)


def _export_checkpoint(path: Path, file: Path, verify: bool) -> None:
    """Full model tensors of a checkpoint directory, read in this process alone, to ``file``."""
    marker, skeleton, stored = _read(path)
    if verify:
        verify_share(path, marker, 0, 1)
    tensors = {}
    for p in _placeholders(skeleton["model"]):
        meta = stored[p[_TENSOR]]
        tensors[p[_TENSOR]] = torch.empty(list(meta.size), dtype=meta.properties.dtype)
    with _quiet_single_process():
        dcp.load(tensors, storage_reader=SafeFileSystemReader(path), no_dist=True)
    _write_safetensors({k.removeprefix("model."): v for k, v in tensors.items()}, file)


def import_safetensors(file: str | os.PathLike, model: nn.Module) -> None:
    """Load full weights from one safetensors ``file`` into ``model``, sharded or not; every rank calls it.

    Every rank checks the file's names and shapes against the model first (a mismatch raises
    :class:`CheckpointError`, model untouched); rank 0 reads the tensors and broadcasts them.
    """
    broadcast = _world_size() > 1
    full: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:  # rank-local checks, agreed below before the broadcast
        st = _safetensors()
        _check_safetensors_fit(Path(file), model)
        if _rank() == 0 or not broadcast:
            full = st.load_file(str(file))
    except Exception as e:  # raised on every rank by _agree
        error = e
    _agree(error, f"{str(file)!r} not imported (model untouched)")
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=True)
    )


def _check_safetensors_fit(file: Path, model: nn.Module) -> None:
    from safetensors import safe_open

    if not file.is_file():
        raise CheckpointError(f"no safetensors file at {str(file)!r}")
    try:
        with safe_open(str(file), framework="pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{str(file)!r} is not a readable safetensors file: {e}") from e
    live = get_model_state_dict(model)
    missing = sorted(set(live) - set(shapes))
    unexpected = sorted(set(shapes) - set(live))
    if missing or unexpected:
        raise CheckpointError(
            f"{str(file)!r} does not fit the model: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    bad = [f"{k}: file {shapes[k]} vs model {list(t.shape)}" for k, t in live.items() if shapes[k] != list(t.shape)]
    if bad:
        raise CheckpointError(f"{str(file)!r} does not fit the model: shapes differ: {bad[:5]}")
