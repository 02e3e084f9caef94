"""Which keys a checkpoint holds against which keys the ranks hold, when ranks hold different ones.

Pipeline stages give each rank a different part of the model. At save, the state JSON must describe
every rank's keys, not rank 0's only: :func:`union_over_ranks` merges the ranks' skeletons (each
distinct skeleton is sent once: the data-parallel replicas of a stage cost a digest). At load,
:func:`fit_error` checks, for one section (model or optimizer), that every key this rank holds is
stored with the same global shape, and collectively that every stored key is held by some rank:
a checkpoint loads on any pp size exactly when the union of the live keys is the stored set.
Both go through tensors (:mod:`ndparallel.distributed.distinct`): nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ndparallel.distributed.distinct import any_rank, distinct_texts
from ndparallel.errors import CheckpointError

__all__ = ["SECTIONS", "fit_error", "union_over_ranks"]

SECTIONS = ("model", "optimizer")
"""The parts of the state JSON whose keys differ between ranks (``extra`` is rank 0's)."""


def _listed(keys: list[str], prefix: str) -> str:
    shown = [prefix + k for k in keys[:5]]
    return f"{shown}{'...' if len(keys) > 5 else ''} ({len(keys)})"


def union_over_ranks(skeleton: dict[str, Any]) -> dict[str, Any]:
    """Collective: ``skeleton`` with its model and optimizer sections the union of every rank's.

    A key two ranks both hold (data-parallel replicas, DTensor shards) must have the same entry
    (placeholder with the global shape, or hyper-parameter value) on both; ranks that disagree, or
    that disagree on whether there is an optimizer, are refused (the same error on every rank)."""
    mine = {name: skeleton[name] for name in SECTIONS if name in skeleton}
    parts = [json.loads(text) for text in distinct_texts(json.dumps(mine, sort_keys=True))]
    if len({tuple(sorted(part)) for part in parts}) > 1:
        raise CheckpointError("some ranks pass an optimizer and others do not: pass one on every rank, or none")
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, entries in part.items():
            into = merged.setdefault(name, {})
            for key, entry in entries.items():
                if into.setdefault(key, entry) != entry:
                    raise CheckpointError(
                        f"ranks disagree on {name} key {key!r}: {json.dumps(into[key])[:120]} vs "
                        f"{json.dumps(entry)[:120]}; ranks holding one key must hold the same shape and value"
                    )
    return {**skeleton, **merged}


def fit_error(
    live: dict[str, Any],
    stored: dict[str, Any],
    metadata: dict[str, Any],
    *,
    section: str,
    path: Path,
    one_way: Callable[[str], bool] = lambda key: False,
) -> CheckpointError | None:
    """Collective: the error if ``live`` (this rank's flat state of ``section``) does not fit ``stored``
    (the checkpoint's section of the state JSON; DCP keys ``<section>.<key>``, shapes in ``metadata``).

    This rank: every live key is stored, a live tensor as a tensor of the same global shape.
    Every rank together: every stored key is held by some rank, except keys for which ``one_way``
    is true (hyper-parameters saved for a parameter the live optimizer no longer lists in a group:
    torch ignores them). Every rank must call it (one all-reduce); the stored keys are the same file."""
    prefix = f"{section}."
    missing, shapes = [], []
    for key, value in live.items():
        if key not in stored:
            missing.append(key)
        elif isinstance(value, torch.Tensor) and not one_way(key):
            meta = metadata.get(prefix + key)
            if meta is None:
                missing.append(key)
            elif not isinstance(meta, TensorStorageMetadata) or list(meta.size) != list(value.shape):
                got = list(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
                shapes.append(f"{prefix}{key}: checkpoint {got} vs {section} {list(value.shape)}")
    candidates = sorted(key for key in stored if not one_way(key))
    held = any_rank([key in live for key in candidates])
    unexpected = [key for key, h in zip(candidates, held, strict=True) if not h]
    where = f"checkpoint {str(path)!r} does not fit the {section}"
    if missing or unexpected:
        return CheckpointError(
            f"{where}: missing {_listed(sorted(missing), prefix)}, unexpected {_listed(unexpected, prefix)}; "
            "was it saved from another model? (with pipeline stages, the ranks together must hold every stored key)"
        )
    if shapes:
        return CheckpointError(f"{where}: shapes differ: {shapes[:5]}")
    return None
