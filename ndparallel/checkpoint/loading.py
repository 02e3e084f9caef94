"""Loading: :func:`load` on any mesh, everything checked and agreed before DCP touches the model.

Every rank validates the checkpoint (:func:`~ndparallel.checkpoint.storage.validate`), reads
DCP's ``.metadata`` without running code (:mod:`~ndparallel.checkpoint.dcp_metadata`), checks
that every tensor of the model (and optimizer) has a saved entry of the same global shape, and
verifies its share of the SHA-256; the ranks agree (:func:`ndparallel.comm.agree.agree`), and
only then does DCP read into the model. A failure anywhere leaves the model and optimizer
untouched, on every rank.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ndparallel.checkpoint import dcp_io
from ndparallel.checkpoint.checksums import verify_share
from ndparallel.checkpoint.dcp_metadata import read_metadata
from ndparallel.checkpoint.format import (
    STATE_FILE,
    empty_like_placeholder,
    join_state,
    placeholder_key,
    placeholders,
    split_state,
)
from ndparallel.checkpoint.rng import rng_prefix, set_rng_states
from ndparallel.checkpoint.storage import validate
from ndparallel.comm.agree import agree, broadcast_text, rank, world_size
from ndparallel.errors import CheckpointError

__all__ = ["load", "read_checkpoint"]


def read_checkpoint(path: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Validate, then read the marker, the state skeleton and DCP's key -> storage metadata."""
    marker = validate(path)
    skeleton = json.loads((path / STATE_FILE).read_text())
    # DCP's .metadata is a pickle written by torch: read with an allow-list of DCP's classes, never run.
    metadata = read_metadata(path)
    return marker, skeleton, metadata.state_dict_metadata


def _check_fits(live: dict[str, torch.Tensor], stored: dict[str, Any], path: Path, section: str, skeleton: Any) -> None:
    """Every live tensor has a stored entry of the same global shape, and vice versa for ``section``."""
    saved_keys = {placeholder_key(p) for p in placeholders(skeleton)}
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


def _model_targets(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, restore_rng: bool
) -> tuple[dict[str, Any], Any, dict[str, Any], dict[str, torch.Tensor], list[str]]:
    """Validate ``path`` and check it against the model; the tensors to read (all but the optimizer's)."""
    marker, skeleton, stored = read_checkpoint(path)
    if optimizer is not None and "optimizer" not in skeleton:
        raise CheckpointError(f"checkpoint {str(path)!r} has no optimizer state; call load without the optimizer")
    targets: dict[str, torch.Tensor] = {}
    split_state(get_model_state_dict(model), "model", targets)
    _check_fits(targets, stored, path, "model", skeleton["model"])
    for p in placeholders(skeleton.get("extra", {})):
        targets[placeholder_key(p)] = empty_like_placeholder(p)
    rng_keys = [k for k in stored if k.startswith(rng_prefix(rank()))] if restore_rng else []
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
    split_state(optim_sd, "optimizer", targets)
    _check_fits(targets, stored, path, "optimizer", skeleton["optimizer"])
    # Tensors among the saved hyper-parameters (e.g. a tensor lr) are not in the live state.
    for p in placeholders(skeleton["optimizer"]):
        targets.setdefault(placeholder_key(p), empty_like_placeholder(p))
    return targets


def _set_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, skeleton: Any, targets: dict[str, torch.Tensor]
) -> None:
    """Put what DCP read (``targets``, in the structure of ``skeleton``) into the model and optimizer."""
    saved_model = join_state(skeleton["model"], targets)
    options = StateDictOptions(strict=True)
    if optimizer is None:
        set_model_state_dict(model, saved_model, options=options)
        return
    saved_optim = join_state(skeleton["optimizer"], targets)
    set_state_dict(model, optimizer, model_state_dict=saved_model, optim_state_dict=saved_optim, options=options)


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
    path with :func:`~ndparallel.checkpoint.resolve_latest`). Every rank validates the checkpoint
    and checks it against the model, and the ranks agree, before anything is read into it: a
    :class:`CheckpointError` (the same on every rank, naming the rank that failed) means the model
    and optimizer are untouched. With ``verify`` (the default) every file is also checked against
    its SHA-256 first, each rank hashing its part; ``verify=False`` skips that read of the whole
    checkpoint (sizes and the small files are still checked). RNG states are restored for ranks
    that saved one (rank ``r`` gets rank ``r``'s) unless ``restore_rng=False``.
    """
    path = Path(path).absolute()
    path0 = broadcast_text(str(path))
    failed = f"checkpoint {path0!r} not loaded (model and optimizer untouched)"
    error: BaseException | None = None
    try:  # rank-local checks, agreed below before DCP's collectives
        if str(path) != path0:
            raise CheckpointError(
                f"rank {rank()} loads {str(path)!r}, rank 0 {path0!r}: every rank must load the same "
                "checkpoint (pick it with resolve_latest(root))"
            )
        marker, skeleton, stored, targets, rng_keys = _model_targets(path, model, optimizer, restore_rng)
        if verify:
            verify_share(path, marker, rank(), world_size())
    except Exception as e:  # raised on every rank by agree
        error = e
    agree(error, failed)
    if optimizer is not None:
        try:
            targets.update(_optimizer_targets(path, model, optimizer, skeleton, stored))
        except Exception as e:  # raised on every rank by agree
            error = e
        agree(error, failed)

    dcp_io.read(targets, path)
    _set_state(model, optimizer, skeleton, targets)
    if rng_keys:
        set_rng_states(targets, rank())
    elif restore_rng and marker.get("rng_ranks", 0) > 0:
        warnings.warn(
            f"checkpoint {str(path)!r} has RNG states for {marker['rng_ranks']} ranks, none for rank {rank()}: "
            "this rank's RNG is not restored",
            stacklevel=2,
        )
    return join_state(skeleton.get("extra", {}), targets)
