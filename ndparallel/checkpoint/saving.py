"""Saving: :func:`save` and :func:`save_async`, every rank's part, agreed at each step.

A save runs in four steps, each ending in an agreement so that a failure seen by one rank raises
the same error on every rank before the next collective (:func:`ndparallel.distributed.agree.agree`):

1. prepare (every rank): the same path on every rank, the state of this rank's modules (one, or
   its pipeline stages; :mod:`~ndparallel.checkpoint.rank_state`) split into JSON and tensors
   (:mod:`~ndparallel.checkpoint.format`), finite model and optimizer tensors, this rank's RNG
   states; the JSON skeleton becomes the union of every rank's (:mod:`~ndparallel.checkpoint.keys`);
   rank 0 creates the stamped temporary directory;
2. write: DCP writes every rank's shards (:mod:`~ndparallel.checkpoint.dcp_io`; in a background
   thread for :func:`save_async`);
3. hash: every rank hashes its share of the written files (:mod:`~ndparallel.checkpoint.checksums`);
4. commit: rank 0 gathers the digests and commits (:func:`~ndparallel.checkpoint.storage.commit`),
   then prunes if ``keep_last`` asks.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor

from ndparallel.checkpoint import dcp_io, leftovers, storage
from ndparallel.checkpoint.checksums import hash_share
from ndparallel.checkpoint.format import split_state
from ndparallel.checkpoint.keys import union_over_ranks
from ndparallel.checkpoint.rank_state import ModelArg, OptimizerArg, RankState, as_modules, as_optimizers
from ndparallel.checkpoint.rng import rng_states
from ndparallel.checkpoint.write_errors import disk_full
from ndparallel.distributed.agree import agree, broadcast_text, gather_text, rank, world_size
from ndparallel.errors import CheckpointError

__all__ = ["AsyncSave", "save", "save_async"]


def _share_bytes(tensors: dict[str, Any]) -> int:
    """The bytes of this rank's shards in ``tensors`` (what its part of the write puts on disk, roughly)."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors.values())
    return sum(t.numel() * t.element_size() for t in local if isinstance(t, torch.Tensor))


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


def _mesh_info(modules: list[nn.Module]) -> list[dict[str, Any]]:
    seen: dict[tuple, dict[str, Any]] = {}
    for p in (p for module in modules for p in module.parameters()):
        if isinstance(p, DTensor):
            m = p.device_mesh
            names = list(m.mesh_dim_names or [f"dim{i}" for i in range(m.ndim)])
            seen.setdefault((tuple(names), tuple(m.shape)), {"dims": names, "shape": list(m.shape)})
    return list(seen.values())


def _split_tree(
    model: ModelArg, optimizer: OptimizerArg, state: dict, save_rng: bool, allow_nonfinite: bool
) -> tuple[dict[str, torch.Tensor], Any, list[nn.Module], bool]:
    """This rank's tensors to write and the JSON skeleton of its model, optimizer and extra state."""
    modules = as_modules(model)
    optimizers = as_optimizers(optimizer, len(modules))
    live = RankState.of(modules, optimizers)
    tree: dict[str, Any] = {"model": live.model}
    if live.optimizer is not None:
        tree["optimizer"] = live.optimizer
    tree["extra"] = state
    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_state(tree, "", tensors)
    if not allow_nonfinite:
        _check_finite(tensors)
    if save_rng:
        tensors.update(rng_states(rank()))
    return tensors, skeleton, modules, optimizers is not None


def _prepare(
    path: str | os.PathLike,
    model: ModelArg,
    optimizer: OptimizerArg,
    save_rng: bool,
    keep_last: int | None,
    allow_nonfinite: bool,
    state: dict,
) -> tuple[Path, Path, str, dict[str, torch.Tensor], Any, dict[str, Any]]:
    path = Path(path).absolute()
    # Rank 0 picks the temporary name and sends it with its path: every rank writes the same directory.
    sent = f"{leftovers.new_token(time.time_ns())} {path}" if rank() == 0 else ""
    token, _, path0 = broadcast_text(sent).partition(" ")
    error: BaseException | None = None
    try:  # everything here is rank-local: agreed below before the next collective
        if str(path) != path0:
            raise CheckpointError(
                f"rank {rank()} saves to {str(path)!r}, rank 0 to {path0!r}: every rank must pass the same path"
            )
        storage.check_keep_last(keep_last)
        if leftovers.reserved(path.name):
            raise CheckpointError(
                f"checkpoint path {str(path)!r} must not end in .tmp-<16 hex> or .old-<16 hex>: reserved"
            )
        tensors, skeleton, modules, has_optimizer = _split_tree(model, optimizer, state, save_rng, allow_nonfinite)
    except Exception as e:  # raised on every rank by agree
        error = e
    agree(error, f"checkpoint {path0!r} not saved (nothing written)")
    try:  # the same parts on every rank, so the same outcome: agreed all the same
        skeleton = union_over_ranks(skeleton)
    except Exception as e:  # raised on every rank by agree
        error = e
    agree(error, f"checkpoint {path0!r} not saved (nothing written)")
    step = state.get("step")
    info = dict(
        step=step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None,
        world_size=world_size(),
        mesh=_mesh_info(modules),
        has_optimizer=has_optimizer,
        rng_ranks=world_size() if save_rng else 0,
    )
    tmp = storage.tmp_path(path, token)
    if rank() == 0:
        try:
            storage.create_tmp(path, tmp)
        except Exception as e:  # raised on every rank by agree
            error = e
    agree(error, f"could not create checkpoint directory {str(tmp)!r}")
    return path, tmp, token, tensors, skeleton, info


def _hash_share(tmp: Path) -> dict[str, str]:
    """Collective: this rank's part of the written files' SHA-256; a failure on any rank fails the save everywhere."""
    digests: dict[str, str] = {}
    error: BaseException | None = None
    try:
        digests = hash_share(tmp, rank(), world_size())
    except Exception as e:  # raised on every rank by agree
        error = e
    try:
        agree(error, f"could not checksum checkpoint files in {str(tmp)!r} (nothing committed)")
    except CheckpointError:
        storage.discard(tmp)
        raise
    return digests


def _finish(
    path: Path, tmp: Path, token: str, skeleton: Any, info: dict, keep_last: int | None, digests: dict[str, str]
) -> str:
    # Every rank's files are written and hashed once every rank's digests arrive.
    gathered = [json.loads(text) for text in gather_text(json.dumps(digests))]
    error: BaseException | None = None
    if rank() == 0:
        try:
            storage.commit(tmp, path, token, skeleton, info, {k: v for part in gathered for k, v in part.items()})
            if keep_last is not None:
                storage.prune_except(path.parent, keep_last, protect=path)
        except Exception as e:  # raised on every rank by agree
            error = e
    agree(error, f"could not commit checkpoint {str(path)!r}")
    return str(path)


def save(
    path: str | os.PathLike,
    model: ModelArg,
    optimizer: OptimizerArg = None,
    *,
    keep_last: int | None = None,
    save_rng: bool = True,
    allow_nonfinite: bool = False,
    **state: Any,
) -> str:
    """Save ``model`` (and ``optimizer``) plus extra ``state`` to directory ``path``; every rank calls it.

    ``model`` is a module, or the list of this rank's pipeline stage modules (keeping the unsplit
    model's parameter names), with ``optimizer`` one optimizer per module in the same order. Ranks
    may hold different keys (pipeline stages): the checkpoint stores the union, and loads on any pp
    size, mesh, or in one process.

    ``state``: tensors and JSON values, e.g. ``step=100, scheduler=sched.state_dict(), data={"pos": 1234}``
    (rank 0's values are kept). Per-rank RNG states are saved unless ``save_rng=False``. A model
    or optimizer tensor with a NaN or inf is refused (nothing written, nothing pruned) unless
    ``allow_nonfinite=True``. The directory appears complete or not at all; an existing one is
    replaced. ``keep_last=k`` then deletes all but the ``k`` most recently committed checkpoints
    in ``path``'s parent, never the one just written (see :func:`~ndparallel.checkpoint.prune`).
    Every rank must pass the same ``path``; a rank-local failure (e.g. extra state only one rank
    cannot store) raises on every rank. Returns the absolute path.
    """
    path, tmp, token, tensors, skeleton, info = _prepare(
        path, model, optimizer, save_rng, keep_last, allow_nonfinite, state
    )
    try:
        dcp_io.write(tensors, tmp)
    except (Exception, CheckpointException) as err:  # DCP reports a failed write on every rank (a BaseException)
        full = disk_full(err, tmp, _share_bytes(tensors))  # before the discard frees the partial files' space
        storage.discard(tmp)
        if full is not None:
            raise full from None
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
            except (Exception, CheckpointException) as e:  # a write that failed on some ranks only must not
                error = e  # strand the others
            try:
                agree(error, "asynchronous checkpoint write failed (nothing committed)")
            except CheckpointError:
                self._discard()
                raise
            self._path = self._finalize(digests)
        return self._path


def save_async(
    path: str | os.PathLike,
    model: ModelArg,
    optimizer: OptimizerArg = None,
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
    hashed = _hash_when_written(dcp_io.write_async(tensors, tmp), tmp, _share_bytes(tensors))
    return AsyncSave(
        hashed,
        lambda digests: _finish(path, tmp, token, skeleton, info, keep_last, digests),
        lambda: storage.discard(tmp),
    )


def _hash_when_written(written: Any, tmp: Path, share_bytes: int) -> concurrent.futures.Future:
    """A future of this rank's share of the SHA-256 (:func:`hash_share`), computed in a background
    thread once DCP's background write ``written`` is done (then every rank's files are on disk)."""
    this_rank, ranks = rank(), world_size()
    hashed: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            written.result()
            hashed.set_result(hash_share(tmp, this_rank, ranks))
        except BaseException as e:  # handed to wait(), which agrees on it across ranks
            hashed.set_exception(disk_full(e, tmp, share_bytes) or e)

    threading.Thread(target=run, name="ndparallel-checkpoint-hash", daemon=True).start()
    return hashed
