"""Loading: :func:`load` on any mesh and pp size, everything checked and agreed before DCP touches the model.

Every rank validates the checkpoint (:func:`~ndparallel.checkpoint.storage.validate`), reads
DCP's ``.metadata`` without running code (:mod:`~ndparallel.checkpoint.dcp_metadata`) and verifies
its share of the SHA-256; the ranks agree (:func:`ndparallel.distributed.agree.agree`). Then the model,
and after it the optimizer, is checked against the checkpoint (:func:`~ndparallel.checkpoint.keys.fit_error`:
this rank's keys are stored with the same global shapes, and the ranks together hold every stored
key), agreed again, and only then does DCP read into the modules. A failure anywhere leaves the
model and optimizer untouched, on every rank; except shard data that passes its SHA-256 (a forger
recomputed it) but that torch cannot read: DCP reads in place, so that error (one line naming the
file, on every rank) says the model may be partly overwritten.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ndparallel.checkpoint import dcp_io
from ndparallel.checkpoint.checksums import verify_share
from ndparallel.checkpoint.format import (
    STATE_FILE,
    empty_like_placeholder,
    join_state,
    placeholder_key,
    placeholders,
    split_state,
)
from ndparallel.checkpoint.keys import fit_error
from ndparallel.checkpoint.rank_state import (
    ModelArg,
    OptimizerArg,
    RankState,
    as_modules,
    as_optimizers,
    flatten_nested_optimizer,
    is_hyper_parameter,
    set_rank_state,
)
from ndparallel.checkpoint.rng import rng_prefix, set_rng_states
from ndparallel.checkpoint.storage import validate_and_read
from ndparallel.distributed.agree import agree, broadcast_text, rank, world_size
from ndparallel.errors import CheckpointError

__all__ = ["load", "read_checkpoint"]


def read_checkpoint(path: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Validate, then read the marker, the state skeleton (optimizer section flat, whatever the version)
    and DCP's key -> storage metadata."""
    marker, metadata = validate_and_read(path)  # DCP's .metadata: read with an allow-list, never run
    skeleton = json.loads((path / STATE_FILE).read_text())
    if not isinstance(skeleton, dict) or not isinstance(skeleton.get("model"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {STATE_FILE} has no 'model' table")
    if "optimizer" in skeleton:
        skeleton["optimizer"] = flatten_nested_optimizer(skeleton["optimizer"])
        if not isinstance(skeleton["optimizer"], dict):
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: the optimizer in {STATE_FILE} is not a table")
    return marker, skeleton, metadata.state_dict_metadata


def _add_targets(live: dict[str, Any], section: str, stored: dict[str, Any], targets: dict[str, torch.Tensor]) -> None:
    """What DCP must read for ``live``'s keys: the live tensors themselves (read in place; their shardings
    decide what this rank reads), and an empty tensor for any other tensor in their stored entries (a tensor
    hyper-parameter, e.g. a tensor lr)."""
    split_state({k: v for k, v in live.items() if not is_hyper_parameter(k)}, section, targets)
    for key in live:
        for p in placeholders(stored[key]):
            targets.setdefault(placeholder_key(p), empty_like_placeholder(p))


def _agree_fit(live: dict[str, Any], skeleton: dict, metadata: dict, section: str, path: Path, failed: str) -> None:
    """Collective: :func:`fit_error` for ``section``, agreed (the same error on every rank)."""
    error: BaseException | None = None
    try:
        one_way = is_hyper_parameter if section == "optimizer" else (lambda key: False)
        error = fit_error(live, skeleton[section], metadata, section=section, path=path, one_way=one_way)
    except Exception as e:  # raised on every rank by agree
        error = e
    agree(error, failed)


def load(
    path: str | os.PathLike,
    model: ModelArg,
    optimizer: OptimizerArg = None,
    *,
    restore_rng: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``), on any mesh and pp size; return the extra state.

    ``model`` is a module, or the list of this rank's pipeline stage modules, with ``optimizer`` one
    optimizer per module in the same order. Every rank calls it with the same ``path`` (or one process
    without a process group; pick the path with :func:`~ndparallel.checkpoint.resolve_latest`). Every
    rank validates the checkpoint and checks it against its modules (every key it holds is stored,
    with the same global shape; the ranks together hold every stored key), and the ranks agree, before
    anything is read into them: a :class:`CheckpointError` (the same on every rank, naming the rank
    that failed) means the model and optimizer are untouched. With ``verify`` (the default) every file
    is also checked against its SHA-256 first, each rank hashing its part; ``verify=False`` skips that
    read of the whole checkpoint (sizes and the small files are still checked). RNG states are restored
    for ranks that saved one (rank ``r`` gets rank ``r``'s) unless ``restore_rng=False``.
    """
    path = Path(path).absolute()
    path0 = broadcast_text(str(path))
    failed = f"checkpoint {path0!r} not loaded (model and optimizer untouched)"
    error: BaseException | None = None
    try:  # rank-local checks, agreed below before any collective
        if str(path) != path0:
            raise CheckpointError(
                f"rank {rank()} loads {str(path)!r}, rank 0 {path0!r}: every rank must load the same "
                "checkpoint (pick it with resolve_latest(root))"
            )
        modules = as_modules(model)
        optimizers = as_optimizers(optimizer, len(modules))
        marker, skeleton, metadata = read_checkpoint(path)
        if optimizers is not None and "optimizer" not in skeleton:
            raise CheckpointError(f"checkpoint {str(path)!r} has no optimizer state; call load without the optimizer")
        live = RankState.of(modules, None)
        if verify:
            verify_share(path, marker, rank(), world_size())
    except Exception as e:  # raised on every rank by agree
        error = e
    agree(error, failed)
    _agree_fit(live.model, skeleton, metadata, "model", path, failed)
    if optimizers is not None:
        # torch's get_state_dict initialises the state of an optimizer that has none (a step with
        # lr 0), so it runs only once every rank knows the files and the model fit.
        try:
            live = RankState.of(modules, optimizers)
            live.check_groups(skeleton["optimizer"])
        except Exception as e:  # raised on every rank by agree
            error = e
        agree(error, failed)
        _agree_fit(live.optimizer, skeleton, metadata, "optimizer", path, failed)

    targets: dict[str, torch.Tensor] = {}
    _add_targets(live.model, "model", skeleton["model"], targets)
    if live.optimizer is not None:
        _add_targets(live.optimizer, "optimizer", skeleton["optimizer"], targets)
    for p in placeholders(skeleton.get("extra", {})):
        targets[placeholder_key(p)] = empty_like_placeholder(p)
    rng_keys = [k for k in metadata if k.startswith(rng_prefix(rank()))] if restore_rng else []
    for k in rng_keys:
        meta = metadata[k]
        targets[k] = torch.empty(list(meta.size), dtype=meta.properties.dtype)

    dcp_io.read(targets, path)
    set_rank_state(modules, optimizers, live, skeleton, targets)
    if rng_keys:
        set_rng_states(targets, rank())
    elif restore_rng and marker.get("rng_ranks", 0) > 0:
        warnings.warn(
            f"checkpoint {str(path)!r} has RNG states for {marker['rng_ranks']} ranks, none for rank {rank()}: "
            "this rank's RNG is not restored",
            stacklevel=2,
        )
    return join_state(skeleton.get("extra", {}), targets)
